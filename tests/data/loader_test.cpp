// The distributed sampler and the loader: coverage, determinism, resume, worker independence.
#include "data/loader.h"
#include "core/error.h"
#include "data/dataset.h"
#include "data/sampler.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <set>

namespace parallax::data {
namespace {

using testing::small_options;
using testing::TempDir;

TEST(SamplerTest, RanksAreDisjointAndCoverTheSplit) {
  for (int64_t size : {1, 10, 11, 13, 64}) {
    for (int world : {1, 2, 3, 4}) {
      for (bool shuffle : {false, true}) {
        std::multiset<int64_t> all;
        int64_t smallest = INT64_MAX, largest = 0;
        for (int rank = 0; rank < world; ++rank) {
          const DistributedSampler s(size, rank, world, shuffle, 42);
          const auto idx = s.indices(3);
          EXPECT_EQ(static_cast<int64_t>(idx.size()), s.rank_size());
          smallest = std::min<int64_t>(smallest, static_cast<int64_t>(idx.size()));
          largest = std::max<int64_t>(largest, static_cast<int64_t>(idx.size()));
          all.insert(idx.begin(), idx.end());
        }
        EXPECT_LE(largest - smallest, 1);
        ASSERT_EQ(static_cast<int64_t>(all.size()), size) << "size " << size << " world " << world;
        int64_t expect = 0;
        for (int64_t v : all) EXPECT_EQ(v, expect++) << "duplicate or missing index";
      }
    }
  }
}

TEST(SamplerTest, EpochsReshuffleDeterministically) {
  const DistributedSampler a(50, 1, 3, true, 9), b(50, 1, 3, true, 9), c(50, 1, 3, true, 10);
  EXPECT_EQ(a.indices(0), b.indices(0));
  EXPECT_EQ(a.indices(5), b.indices(5));
  EXPECT_NE(a.indices(0), a.indices(1));
  EXPECT_NE(a.indices(0), c.indices(0));
  const DistributedSampler ordered(10, 0, 2, false, 9);
  EXPECT_EQ(ordered.indices(0), (std::vector<int64_t>{0, 2, 4, 6, 8}));
  EXPECT_EQ(ordered.indices(0), ordered.indices(7));
}

TEST(SamplerTest, DropLastGivesEveryRankTheSameBatchCount) {
  for (int world : {1, 2, 3, 4}) {
    std::set<int64_t> counts;
    int64_t covered = 0;
    for (int rank = 0; rank < world; ++rank) {
      const DistributedSampler s(23, rank, world, true, 1);
      counts.insert(s.num_batches(2, true));
      covered += s.samples_used(2, false);
      EXPECT_EQ(s.num_batches(2, false), (s.rank_size() + 1) / 2);
    }
    EXPECT_EQ(counts.size(), 1u) << "world " << world;
    EXPECT_EQ(*counts.begin(), (23 / world) / 2);
    EXPECT_EQ(covered, 23);
  }
}

class LoaderTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>("loader");
    generate_dataset(small_options(dir_->str(), 11, 5));
    train_ = Dataset::open(dir_->str(), "train");
    val_ = Dataset::open(dir_->str(), "val");
  }
  static void TearDownTestSuite() {
    train_.reset();
    val_.reset();
    dir_.reset();
  }
  static LoaderOptions train_options(int workers) {
    LoaderOptions o;
    o.batch_size = 2;
    o.num_workers = workers;
    o.prefetch = 3;
    o.augment = true;
    o.seed = 17;
    return o;
  }
  static std::unique_ptr<TempDir> dir_;
  static std::shared_ptr<Dataset> train_, val_;
};
std::unique_ptr<TempDir> LoaderTest::dir_;
std::shared_ptr<Dataset> LoaderTest::train_, LoaderTest::val_;

void expect_same_batch(const core::TensorDict& a, const core::TensorDict& b,
                       const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  // Bit for bit, NaN (an unknown velocity) equal to NaN.
  for (const auto& [k, v] : a) {
    const at::Tensor& w = b.at(k);
    const bool same = v.is_floating_point()
                          ? v.sizes() == w.sizes() && at::allclose(v, w, 0, 0, /*equal_nan=*/true)
                          : at::equal(v, w);
    EXPECT_TRUE(same) << what << ": key " << k;
  }
}

TEST_F(LoaderTest, BatchesHaveTheDocumentedKeysShapesAndDtypes) {
  DataLoader loader(train_, train_options(2));
  const auto b = loader.next();
  ASSERT_TRUE(b.has_value());
  const std::map<std::string, std::pair<at::ScalarType, std::vector<int64_t>>> want = {
      {"images", {at::kByte, {2, 4, 48, 80, 3}}}, {"intrinsics", {at::kFloat, {2, 4, 3, 3}}},
      {"cam_to_ego", {at::kFloat, {2, 4, 4, 4}}}, {"bev_semantics", {at::kLong, {2, 100, 100}}},
      {"boxes", {at::kFloat, {2, 64, 9}}},        {"velocities", {at::kFloat, {2, 64, 2}}},
      {"scene_index", {at::kLong, {2}}}};
  ASSERT_EQ(b->size(), want.size());
  for (const auto& [k, v] : want) {
    ASSERT_TRUE(b->count(k)) << k;
    EXPECT_EQ(b->at(k).scalar_type(), v.first) << k;
    EXPECT_EQ(b->at(k).sizes().vec(), v.second) << k;
  }
  // Padding rows: class -1 and nothing else; real rows have a class in [0, 3).
  const at::Tensor boxes = b->at("boxes");
  const at::Tensor cls = boxes.select(2, kBoxClass);
  const at::Tensor pad = cls == -1;
  EXPECT_TRUE(pad.any().item<bool>());
  EXPECT_TRUE((((cls >= 0) & (cls < 3)) | pad).all().item<bool>());
  EXPECT_TRUE((boxes.select(2, kBoxX).masked_select(pad) == 0).all().item<bool>());
  const at::Tensor idx = b->at("scene_index");
  EXPECT_TRUE(((idx >= 0) & (idx < 11)).all().item<bool>());
  EXPECT_EQ(loader.batches_per_epoch(), 5);
  // A static dataset stores no velocities: every entry unknown.
  EXPECT_TRUE(at::isnan(b->at("velocities")).all().item<bool>());
}

TEST_F(LoaderTest, AnyWorkerCountGivesTheSameBatches) {
  DataLoader l0(train_, train_options(0)), l1(train_, train_options(1)),
      l3(train_, train_options(3));
  for (int i = 0; i < 8; ++i) {  // crosses into the second epoch (5 batches per epoch)
    const auto a = l0.next(), b = l1.next(), c = l3.next();
    expect_same_batch(*a, *b, fmt::format("0 vs 1 workers, batch {}", i));
    expect_same_batch(*a, *c, fmt::format("0 vs 3 workers, batch {}", i));
  }
  EXPECT_EQ(l0.state(), l3.state());
  EXPECT_EQ(l0.state(), (LoaderState{1, 6}));
}

TEST_F(LoaderTest, RestoredStateYieldsExactlyTheRemainingBatches) {
  for (int skip : {2, 4, 5, 7}) {
    DataLoader a(train_, train_options(2));
    for (int i = 0; i < skip; ++i) a.next();
    const LoaderState saved = a.state();
    std::vector<core::TensorDict> expected;
    for (int i = 0; i < 6; ++i) expected.push_back(*a.next());
    DataLoader b(train_, train_options(1), saved);
    for (int i = 0; i < 6; ++i)
      expect_same_batch(expected[static_cast<size_t>(i)], *b.next(), "after restore");
    EXPECT_EQ(a.state(), b.state());
  }
}

TEST_F(LoaderTest, EpochsReshuffleAndAugmentDifferently) {
  LoaderOptions o = train_options(1);
  o.batch_size = 1;
  DataLoader l(train_, o);
  std::vector<int64_t> e0, e1;
  std::map<int64_t, at::Tensor> img0;
  for (int i = 0; i < 11; ++i) {
    const auto b = *l.next();
    e0.push_back(b.at("scene_index")[0].item<int64_t>());
    img0[e0.back()] = b.at("images")[0];
  }
  int same_images = 0;
  for (int i = 0; i < 11; ++i) {
    const auto b = *l.next();
    e1.push_back(b.at("scene_index")[0].item<int64_t>());
    same_images += at::equal(img0[e1.back()], b.at("images")[0]) ? 1 : 0;
  }
  EXPECT_NE(e0, e1);
  EXPECT_EQ(std::set<int64_t>(e0.begin(), e0.end()).size(), 11u);
  EXPECT_EQ(std::set<int64_t>(e1.begin(), e1.end()).size(), 11u);
  EXPECT_EQ(same_images, 0) << "augmentation must depend on the epoch";
}

TEST_F(LoaderTest, EvaluationPassCoversTheSplitOnceAcrossRanks) {
  std::multiset<int64_t> seen;
  for (int rank = 0; rank < 3; ++rank) {
    LoaderOptions o;
    o.batch_size = 2;
    o.num_workers = 2;
    o.shuffle = false;
    o.drop_last = false;
    o.repeat = false;
    o.rank = rank;
    o.world = 3;
    DataLoader l(val_, o);
    int batches = 0;
    while (auto b = l.next()) {
      ++batches;
      for (int64_t i = 0; i < b->at("scene_index").size(0); ++i)
        seen.insert(b->at("scene_index")[i].item<int64_t>());
      // Without augmentation the batch holds the stored scene.
      const SceneRecord r = val_->read(b->at("scene_index")[0].item<int64_t>());
      EXPECT_TRUE(at::equal(b->at("images")[0], r.images));
      EXPECT_TRUE(at::equal(b->at("cam_to_ego")[0], r.cam_to_ego));
      EXPECT_TRUE(at::equal(b->at("bev_semantics")[0], r.bev_semantics.to(at::kLong)));
    }
    EXPECT_EQ(batches, l.batches_per_epoch());
    EXPECT_FALSE(l.next().has_value());
  }
  EXPECT_EQ(seen, (std::multiset<int64_t>{0, 1, 2, 3, 4}));
}

TEST_F(LoaderTest, BatchesArePinnedWhenCudaIsAvailable) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA: batches stay in pageable memory";
  DataLoader l(train_, train_options(2));
  const auto b = *l.next();
  for (const auto& [k, v] : b) EXPECT_TRUE(v.is_pinned()) << k;
  const auto d = core::to_device(b, c10::Device(c10::DeviceType::CUDA, 0), true);
  EXPECT_TRUE(at::equal(d.at("images").cpu(), b.at("images")));
  LoaderOptions o = train_options(1);
  o.pin_memory = false;
  DataLoader u(train_, o);
  EXPECT_FALSE(u.next()->at("images").is_pinned());
}

TEST_F(LoaderTest, RejectsOptionsThatCannotWork) {
  LoaderOptions o = train_options(0);
  o.batch_size = 4;
  o.world = 3;  // 11 scenes / 3 ranks = 3 per rank: no full batch of 4
  o.rank = 2;
  EXPECT_THROW(DataLoader(train_, o), DataError);
  EXPECT_THROW(DataLoader(train_, train_options(0), LoaderState{0, 99}), DataError);
}

TEST_F(LoaderTest, FromConfigSeparatesTrainingAndEvaluation) {
  DataConfig cfg;
  cfg.batch_size = 3;
  cfg.aug.resize = {0.9, 1.2};
  const auto t = LoaderOptions::from_config(cfg, 5, 1, 2, true);
  EXPECT_TRUE(t.repeat && t.augment && t.shuffle && t.drop_last);
  EXPECT_EQ(t.batch_size, 3);
  EXPECT_EQ(t.aug.resize_max, 1.2);  // copied from the config: exact
  const auto e = LoaderOptions::from_config(cfg, 5, 1, 2, false);
  EXPECT_FALSE(e.repeat || e.augment || e.shuffle || e.drop_last);
  cfg.aug.resize = {1.2};
  EXPECT_THROW(LoaderOptions::from_config(cfg, 5, 0, 1, true), ConfigError);
}

}  // namespace
}  // namespace parallax::data
