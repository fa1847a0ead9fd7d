// The run's config across resumes: the keys that changed since a checkpoint (old -> new, lists as
// one value, ignored keys skipped, added and removed keys), and the run directory's config history
// (the replaced config.yaml kept under config_history/ with the step it was replaced at).
#include "checkpoint/config_record.h"
#include "checkpoint/files.h"
#include "core/error.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <random>

using namespace parallax;
using namespace parallax::checkpoint;
using parallax::ckpt_test::ScratchDir;
namespace fs = std::filesystem;

namespace {

// A resolved config as the trainer writes it (17 significant digits for doubles).
std::string config(const std::string& lr, int batch, const std::string& betas,
                   const std::string& resume, const std::string& extra = "") {
  return "experiment:\n  name: demo\n  seed: 42\nmodel:\n  size: tiny\ndata:\n  batch_size: " +
         std::to_string(batch) + "\noptim:\n  lr: " + lr + "\n  betas: " + betas +
         "\ntrain:\n  resume: \"" + resume + "\"\n" + extra;
}

}  // namespace

TEST(ConfigRecordTest, DiffListsEachChangedKeyOldToNew) {
  std::mt19937 rng(static_cast<unsigned>(ckpt_test::fresh_seed()));
  const int batch = 8 + static_cast<int>(rng() % 100);
  const std::string before =
      config("0.0030000000000000001", batch, "[0.90000000000000002, 0.999]", "");
  EXPECT_TRUE(diff_configs(before, before).empty());
  // Same values in another spelling are no change; train.resume is ignored as asked.
  EXPECT_TRUE(diff_configs(before, config("0.003", batch, "[0.9, 0.999]", "auto"), {"train.resume"})
                  .empty());
  const auto changes = diff_configs(
      before, config("0.001", batch * 2, "[0.8, 0.999]", "auto", "precision:\n  mode: bf16\n"),
      {"train.resume"});
  ASSERT_EQ(changes.size(), 4u) << describe_changes(changes);
  EXPECT_EQ(describe_changes(changes),
            "data.batch_size: " + std::to_string(batch) + " -> " + std::to_string(batch * 2) +
                ", optim.lr: 0.003 -> 0.001, optim.betas: [0.9, 0.999] -> [0.8, 0.999], "
                "precision.mode: (absent) -> bf16");
  const auto removed = diff_configs(before + "qat:\n  bits: 8\n", before);
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0].key, "qat.bits");
  EXPECT_EQ(removed[0].after, "(absent)");
  // Without the ignore list the resume key shows up.
  EXPECT_EQ(diff_configs(before, config("0.003", batch, "[0.9, 0.999]", "auto")).size(), 1u);
  const auto model = changes_under(changes, {"model.", "precision."});
  ASSERT_EQ(model.size(), 1u);
  EXPECT_EQ(model[0].key, "precision.mode");
  EXPECT_THROW(diff_configs("- a\n- b\n", before), CheckpointError);
  EXPECT_THROW(diff_configs(before, "a: [1, 2\n"), CheckpointError);
}

TEST(ConfigRecordTest, HistoryKeepsEachReplacedConfigWithItsStep) {
  ScratchDir tmp("history");
  const std::string run = tmp.str();
  const std::string a = config("0.003", 32, "[0.9, 0.999]", "");
  const std::string b = config("0.001", 32, "[0.9, 0.999]", "auto");
  const std::string c = config("0.0005", 16, "[0.9, 0.999]", "auto");
  EXPECT_EQ(record_config(run, a, 0), "");  // first start: nothing to keep
  EXPECT_EQ(files::read_text(run + "/config.yaml"), a);
  EXPECT_EQ(record_config(run, a, 4), "");  // same config: no history entry
  EXPECT_FALSE(fs::exists(fs::path(run) / kConfigHistoryDir));
  const std::string first = record_config(run, b, 4);
  EXPECT_EQ(first, (fs::path(run) / kConfigHistoryDir / "step_00000004.yaml").string());
  EXPECT_EQ(files::read_text(first), a);
  EXPECT_EQ(files::read_text(run + "/config.yaml"), b);
  // Replaced again at the same step (a second resume from the same checkpoint): kept beside.
  const std::string second = record_config(run, c, 4);
  EXPECT_EQ(second, (fs::path(run) / kConfigHistoryDir / "step_00000004-1.yaml").string());
  EXPECT_EQ(files::read_text(second), b);
  EXPECT_EQ(files::read_text(first), a);
  EXPECT_EQ(files::read_text(run + "/config.yaml"), c);
}
