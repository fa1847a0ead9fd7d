// The trainer's batch sources: a step's samples depend on the global batch only, so a run resumed
// with another data-parallel size (and the same global batch) continues with the same data.
#include "train/batch_source.h"
#include "models/mlp.h"
#include "tests/data/test_util.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

namespace parallax::train {
namespace {

using data::testing::small_options;
using data::testing::TempDir;

std::vector<int64_t> indices(const core::TensorDict& b) {
  const at::Tensor t = b.at("scene_index").cpu().contiguous();
  return {t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel()};
}

TEST(SyntheticSourceTest, OneRankWithTheGlobalBatchSeesWhatTwoRanksSee) {
  models::MlpModel model(8, 16, 4, 2);
  const c10::Device cpu(c10::kCPU);
  auto one = make_synthetic_source(model, 6, 3, 11, 0, cpu);
  auto r0 = make_synthetic_source(model, 3, 3, 11, 0, cpu);
  auto r1 = make_synthetic_source(model, 3, 3, 11, 1, cpu);
  for (int step = 0; step < 5; ++step) {  // past the cycle of 3 distinct batches
    const core::TensorDict g = one->next(), a = r0->next(), b = r1->next();
    for (const auto& [key, t] : g) {
      EXPECT_TRUE(at::equal(t, at::cat({a.at(key), b.at(key)}, 0))) << key << " at step " << step;
    }
  }
  // A resumed source continues the cycle: position counts global batches, for any dp.
  auto resumed = make_synthetic_source(model, 3, 3, 11, 1, cpu, 4);
  auto fresh = make_synthetic_source(model, 3, 3, 11, 1, cpu);
  for (int i = 0; i < 4; ++i) fresh->next();
  EXPECT_TRUE(at::equal(resumed->next().at("x"), fresh->next().at("x")));
  EXPECT_FALSE(at::equal(r0->next().at("x"), r1->next().at("x")))
      << "ranks must hold different samples";
}

TEST(DatasetSourceTest, PositionIsRemappedWhenTheDataParallelSizeChanges) {
  TempDir dir("batch_source");
  data::generate_dataset(small_options(dir.str(), 16, 1));
  data::DataConfig cfg;
  cfg.path = dir.str();
  cfg.num_workers = 1;
  cfg.augment = false;
  cfg.pin_memory = false;
  const uint64_t seed = 5;
  // Reference: 2 ranks x 2 scenes per step for 6 steps (the epoch has 16 / 4 = 4 steps).
  cfg.batch_size = 2;
  std::vector<std::set<int64_t>> ref;
  {
    auto a = make_dataset_source(cfg, seed, 0, 2), b = make_dataset_source(cfg, seed, 1, 2);
    for (int step = 0; step < 6; ++step) {
      std::set<int64_t> s;
      for (int64_t i : indices(a->next())) s.insert(i);
      for (int64_t i : indices(b->next())) s.insert(i);
      ASSERT_EQ(s.size(), 4u);
      ref.push_back(s);
    }
  }
  // Positions count samples of a rank's list. After 1 step on 2 ranks each is at 2 (4 scenes of
  // the epoch's permutation consumed): 1 rank x 4 continues at 4, i.e. with global step 1, and
  // stays aligned across the epoch boundary.
  cfg.batch_size = 4;
  auto one = make_dataset_source(cfg, seed, 0, 1, {0, 2}, 2);
  for (int step = 1; step < 6; ++step) {
    const auto got = indices(one->next());
    EXPECT_EQ(std::set<int64_t>(got.begin(), got.end()), ref[static_cast<size_t>(step)])
        << "step " << step;
  }
  // Without the remap (position 2 taken as is) the stream would replay scenes: the test can fail.
  const auto w = indices(make_dataset_source(cfg, seed, 0, 1, {0, 2}, 1)->next());
  EXPECT_NE(std::set<int64_t>(w.begin(), w.end()), ref[1]);
  // And back: 1 rank saved after 2 steps (position 8) -> 2 ranks continue at 4 each, global step 2.
  cfg.batch_size = 2;
  auto a = make_dataset_source(cfg, seed, 0, 2, {0, 8}, 1),
       b = make_dataset_source(cfg, seed, 1, 2, {0, 8}, 1);
  std::set<int64_t> s;
  for (int64_t i : indices(a->next())) s.insert(i);
  for (int64_t i : indices(b->next())) s.insert(i);
  EXPECT_EQ(s, ref[2]);
}

}  // namespace
}  // namespace parallax::train
