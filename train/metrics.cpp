#include "train/metrics.h"

#include "core/error.h"
#include "core/files.h"
#include "core/strings.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

namespace fs = std::filesystem;

namespace parallax::train {
namespace {

constexpr const char* kSummaryPrefix = "{\"kind\": \"summary\"";

// The step of a row as MetricsWriter::write formats it ({"kind": ..., "step": N, ...}), or nullopt
// for a line that is not one.
std::optional<int64_t> row_step(const std::string& line) {
  if (!core::starts_with(line, "{\"kind\": \"") || line.back() != '}') return std::nullopt;
  const size_t pos = line.find("\", \"step\": ");
  if (pos == std::string::npos) return std::nullopt;
  const char* begin = line.c_str() + pos + 11;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(begin, &end, 10);
  if (end == begin || errno != 0 || (*end != ',' && *end != '}')) return std::nullopt;
  return static_cast<int64_t>(v);
}

void fsync_or_throw(int fd, const std::string& path) {
  if (::fsync(fd) != 0)
    throw_error<IoError>("cannot sync '{}' to disk: {}", path, std::strerror(errno));
}

}  // namespace

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  file_ = std::fopen(path.c_str(), "a");
  if (!file_) throw_error<IoError>("cannot open metrics file '{}': {}", path, std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const std::string& kind, int64_t step,
                          const std::map<std::string, double>& values) {
  if (!file_) return;
  std::string line = fmt::format("{{\"kind\": {}, \"step\": {}", core::json_quote(kind), step);
  for (const auto& [k, v] : values) {
    if (std::isfinite(v))
      line += fmt::format(", {}: {}", core::json_quote(k), v);
    else
      line += fmt::format(", {}: null", core::json_quote(k));
  }
  line += "}\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    throw_error<IoError>("cannot write metrics to '{}': {}", path_, std::strerror(errno));
  }
}

void MetricsWriter::write_json(const std::string& kind, int64_t step, const std::string& object) {
  if (!file_) return;
  // `object` is "{...}": its members follow kind and step on the same line.
  const std::size_t open = object.find('{'), close = object.rfind('}');
  PARALLAX_CHECK(open != std::string::npos && close != std::string::npos && open < close, Error,
                 "metrics row '{}': not a JSON object", kind);
  const std::string members = core::trim(object.substr(open + 1, close - open - 1));
  const std::string line =
      fmt::format("{{\"kind\": {}, \"step\": {}{}{}}}\n", core::json_quote(kind), step,
                  members.empty() ? "" : ", ", members);
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    throw_error<IoError>("cannot write metrics to '{}': {}", path_, std::strerror(errno));
  }
}

void MetricsWriter::sync() {
  if (!file_) return;
  if (std::fflush(file_) != 0)
    throw_error<IoError>("cannot write metrics to '{}': {}", path_, std::strerror(errno));
  fsync_or_throw(fileno(file_), path_);
}

MetricsTrim trim_metrics(const std::string& path, int64_t last_step) {
  MetricsTrim out;
  std::error_code ec;
  if (!fs::exists(path, ec)) return out;
  std::string text;
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw_error<IoError>("cannot read metrics file '{}': {}", path, std::strerror(errno));
    std::ostringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  std::string kept;
  size_t begin = 0;
  while (begin < text.size()) {
    const size_t eol = text.find('\n', begin);
    if (eol == std::string::npos) {  // torn: the writer was killed inside this line
      ++out.broken;
      break;
    }
    const std::string line = text.substr(begin, eol - begin);
    begin = eol + 1;
    if (line.empty()) continue;
    const auto step = row_step(line);
    if (!step) {
      ++out.broken;
    } else if (*step > last_step || core::starts_with(line, kSummaryPrefix)) {
      ++out.dropped;
    } else {
      ++out.kept;
      kept += line;
      kept += '\n';
    }
  }
  if (out.dropped == 0 && out.broken == 0) return out;
  core::write_file_atomic(path, kept);  // temporary file, fsync, rename, fsync of the folder
  return out;
}

double peak_flops_per_gpu(optim::Precision mode) {
  return mode == optim::Precision::kFp32 ? 67e12 : 989e12;
}

}  // namespace parallax::train
