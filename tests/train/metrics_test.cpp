// metrics.jsonl across kills and resumes: trim_metrics keeps the rows of steps <= S (train and
// eval), drops later rows, summary rows and a torn last line, atomically; the file is left alone
// when nothing is to be dropped; sync() makes rows durable. Rows are written by MetricsWriter
// itself, so the parser and the writer agree on the format.
#include "train/metrics.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace parallax::train {
namespace {

namespace fs = std::filesystem;

struct TempRun {
  fs::path dir;
  TempRun() {
    dir =
        fs::temp_directory_path() / ("parallax_metrics_" + std::to_string(std::random_device{}()));
    fs::create_directories(dir);
  }
  ~TempRun() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::string path() const { return (dir / "metrics.jsonl").string(); }
};

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

TEST(MetricsTrimTest, KeepsRowsUpToTheResumeStepAndDropsLaterSummaryAndTornLines) {
  TempRun run;
  std::mt19937 rng(std::random_device{}());
  const int64_t n = 12 + static_cast<int64_t>(rng() % 20),
                resume = 1 + static_cast<int64_t>(rng() % (n - 2));
  {
    MetricsWriter w(run.path());
    for (int64_t s = 1; s <= n; ++s) {
      w.write("train", s,
              {{"loss", 1.0 / static_cast<double>(s)}, {"step_ms", 3.5}, {"grad_norm", NAN}});
      if (s % 4 == 0) w.write("eval", s, {{"val_loss", 0.5}, {"miou", 0.25}});
    }
    w.write("summary", n, {{"loss", 0.1}, {"samples_per_s", 100.0}, {"wall_s", 3.0}});
  }
  const std::string full = read(run.path());
  std::string expected;
  for (const std::string& l : lines(full)) {
    const size_t p = l.find("\"step\": ");
    const int64_t step = std::stoll(l.substr(p + 8));
    if (step <= resume && l.find("\"summary\"") == std::string::npos) expected += l + "\n";
  }
  // A kill inside a write leaves a torn last line.
  {
    std::ofstream(run.path(), std::ios::app)
        << "{\"kind\": \"train\", \"step\": " << n + 1 << ", \"lo";
  }
  const MetricsTrim t = trim_metrics(run.path(), resume);
  EXPECT_EQ(read(run.path()), expected);
  EXPECT_EQ(t.kept, static_cast<int64_t>(lines(expected).size()));
  EXPECT_EQ(t.kept + t.dropped, static_cast<int64_t>(lines(full).size()));
  EXPECT_EQ(t.broken, 1);
  for (const auto& e : fs::directory_iterator(run.dir))
    EXPECT_EQ(e.path().filename().string(), "metrics.jsonl") << "a temporary file was left behind";

  // Appending after the trim continues the file; nothing to drop leaves it as it is.
  {
    MetricsWriter w(run.path());
    w.write("train", resume + 1, {{"loss", 0.75}});
    w.sync();
  }
  const std::string appended = read(run.path());
  EXPECT_EQ(appended.substr(0, expected.size()), expected);
  const auto before = fs::last_write_time(run.path());
  const MetricsTrim none = trim_metrics(run.path(), resume + 1);
  EXPECT_EQ(none.dropped + none.broken, 0);
  EXPECT_EQ(read(run.path()), appended);
  EXPECT_EQ(fs::last_write_time(run.path()), before);
  // A fresh start (step 0) keeps no row; a missing file is no error.
  trim_metrics(run.path(), 0);
  EXPECT_EQ(read(run.path()), "");
  const MetricsTrim missing = trim_metrics((run.dir / "absent.jsonl").string(), 5);
  EXPECT_EQ(missing.kept + missing.dropped + missing.broken, 0);
  EXPECT_FALSE(fs::exists(run.dir / "absent.jsonl"));
}

}  // namespace
}  // namespace parallax::train

// MFU's denominator follows the precision: an fp32 run measured against the bf16 tensor-core peak
// would report ~15x too low a utilisation (issue 17).
TEST(MfuPeakTest, PeakFollowsThePrecisionOfTheMatmuls) {
  EXPECT_EQ(parallax::train::peak_flops_per_gpu(parallax::optim::Precision::kBf16), 989e12);
  EXPECT_EQ(parallax::train::peak_flops_per_gpu(parallax::optim::Precision::kFp16), 989e12);
  EXPECT_EQ(parallax::train::peak_flops_per_gpu(parallax::optim::Precision::kFp32), 67e12);
}
