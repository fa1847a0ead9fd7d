// Class-balanced grouping and sampling (data/cbgs.h): every class drawn equally often, a fresh
// draw each epoch, ranks that never share a scene and read the same number of slots, and the
// loader's data.sampler=cbgs on a generated dataset.
#include "data/cbgs.h"
#include "core/error.h"
#include "data/datagen.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "data/sampler.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <map>
#include <set>

namespace parallax::data {
namespace {

// 200 scenes: class 0 in 180 of them, class 1 in 40, class 2 (rare) in 10, 10 scenes empty.
std::vector<std::vector<int>> imbalanced() {
  std::vector<std::vector<int>> s(200);
  for (int i = 0; i < 180; ++i) s[i].insert(s[i].end(), {0, 0, 0});
  for (int i = 150; i < 190; ++i) s[i].push_back(1);
  for (int i = 0; i < 10; ++i) s[i * 7].push_back(2);
  // An out-of-range class is ignored: scene 199 stays empty.
  s[199].push_back(7);
  return s;
}

TEST(CbgsTest, EveryClassIsDrawnEquallyOftenAndRareScenesComeBack) {
  const auto scenes = imbalanced();
  const CbgsGroups g = cbgs_groups(scenes, 3);
  ASSERT_EQ(g.scenes.size(), 3u);
  // Groups: class 0 in scenes 0..179 (180), class 1 in 150..189 (40), class 2 in 0, 7, .., 63.
  EXPECT_EQ(g.scenes[0].size(), 180u);
  EXPECT_EQ(g.scenes[1].size(), 40u);
  EXPECT_EQ(g.scenes[2].size(), 10u);
  EXPECT_EQ(g.draws_per_class, (180 + 40 + 10) / 3);
  EXPECT_EQ(g.epoch_slots, 3 * g.draws_per_class);
  const std::vector<int64_t> draw = cbgs_draw(g, 11, 0);
  ASSERT_EQ(static_cast<int64_t>(draw.size()), g.epoch_slots);
  // The k-th block of draws_per_class slots comes from group k only.
  for (int c = 0; c < 3; ++c) {
    const std::set<int64_t> members(g.scenes[c].begin(), g.scenes[c].end());
    for (int64_t k = 0; k < g.draws_per_class; ++k)
      EXPECT_TRUE(members.count(draw[c * g.draws_per_class + k])) << c << " " << k;
  }
  // The rare class: 10 of 200 scenes (5%) before; after, at least its own third of the slots
  // hold it (the other groups' draws may add some).
  int64_t rare = 0;
  for (int64_t s : draw) rare += std::count(scenes[s].begin(), scenes[s].end(), 2) > 0;
  EXPECT_GE(rare, g.draws_per_class);
  // Scenes without boxes are never drawn.
  for (int64_t s : draw) EXPECT_LT(s, 190) << "scenes 190..199 hold no class";
  // Deterministic in (seed, epoch), and a fresh draw every epoch.
  EXPECT_EQ(cbgs_draw(g, 11, 0), draw);
  EXPECT_NE(cbgs_draw(g, 11, 1), draw);
  EXPECT_NE(cbgs_draw(g, 12, 0), draw);
}

TEST(CbgsTest, RanksNeverShareAScene) {
  const auto groups = std::make_shared<const CbgsGroups>(cbgs_groups(imbalanced(), 3));
  for (int world : {1, 3}) {
    for (int64_t epoch : {0, 1, 5}) {
      const std::vector<int64_t> draw = cbgs_draw(*groups, 4, epoch);
      std::map<int64_t, int> owner;
      std::map<int64_t, int64_t> drawn;
      for (int64_t s : draw) ++drawn[s];
      int64_t size = -1;
      for (int r = 0; r < world; ++r) {
        const DistributedSampler sampler(groups, r, world, 4);
        const std::vector<int64_t> mine = sampler.indices(epoch);
        if (size < 0) size = static_cast<int64_t>(mine.size());
        EXPECT_EQ(static_cast<int64_t>(mine.size()), size) << "every rank the same length";
        EXPECT_EQ(size, groups->epoch_slots / world);
        EXPECT_EQ(sampler.rank_size(), size);
        EXPECT_EQ(mine, sampler.indices(epoch));  // deterministic
        for (int64_t s : mine) {
          ASSERT_TRUE(drawn.count(s)) << "scene " << s << " was not drawn";
          const auto [it, fresh] = owner.emplace(s, r);
          EXPECT_EQ(it->second, r) << "scene " << s << " on ranks " << it->second << " and " << r;
        }
      }
      // One rank reads the whole draw; several read all but the balancing's cut, and the split
      // is near even (each rank's load within the largest copy count of floor(slots / world)).
      if (world == 1) {
        std::map<int64_t, int64_t> got;
        for (int64_t s : DistributedSampler(groups, 0, 1, 4).indices(epoch)) ++got[s];
        EXPECT_EQ(got, drawn);
      } else {
        EXPECT_GE(static_cast<int64_t>(owner.size()) * 10, static_cast<int64_t>(drawn.size()) * 9);
      }
    }
  }
}

TEST(CbgsTest, RefusesSplitsItCannotBalance) {
  std::vector<std::vector<int>> none(5);
  testing::expect_data_error([&] { cbgs_groups(none, 3); }, {"data.sampler=cbgs", "5 scenes"});
  std::vector<std::vector<int>> two = {{0}, {1}};
  const auto g = std::make_shared<const CbgsGroups>(cbgs_groups(two, 2));
  testing::expect_data_error([&] { DistributedSampler(g, 0, 3, 1).indices(0); },
                             {"data.sampler=cbgs", "3 data-parallel ranks"});
}

TEST(CbgsTest, LoaderDrawsClassBalancedScenesOfTheDataset) {
  testing::TempDir dir("cbgs");
  generate_dataset(testing::small_options(dir.str(), 12, 2));
  const auto ds = Dataset::open(dir.str(), "train");
  LoaderOptions o;
  o.batch_size = 2;
  o.num_workers = 1;
  o.class_balanced = true;
  o.seed = 3;
  std::map<int64_t, int> owner;
  for (int r = 0; r < 2; ++r) {
    o.rank = r;
    o.world = 2;
    DataLoader loader(ds, o);
    const int64_t n = loader.batches_per_epoch();
    ASSERT_GT(n, 0);
    for (int64_t b = 0; b < n; ++b) {
      const auto batch = loader.next();
      ASSERT_TRUE(batch.has_value());
      const at::Tensor idx = batch->at("scene_index");
      for (int64_t i = 0; i < idx.size(0); ++i) {
        const int64_t s = idx[i].item<int64_t>();
        const auto [it, fresh] = owner.emplace(s, r);
        EXPECT_EQ(it->second, r) << "scene " << s;
        // Every drawn scene holds a visible box.
        EXPECT_FALSE(ds->shard_of(s).visible_box_classes(s).empty());
      }
    }
  }
  // The same epoch length as the sampler says, from the dataset's own boxes.
  o.rank = 0;
  o.world = 1;
  const DistributedSampler s = make_sampler(*ds, o);
  std::vector<std::vector<int>> classes;
  for (int64_t i = 0; i < ds->size(); ++i)
    classes.push_back(ds->shard_of(i).visible_box_classes(i));
  EXPECT_EQ(s.size(), cbgs_groups(classes, 3).epoch_slots);
}

}  // namespace
}  // namespace parallax::data
