// The loader's previous keyframes (data.frames, docs/data.md "Frames") on generated sequences: the
// previous frames are the scenes along prev_index with their own cameras, prev_to_current moves a
// static world point onto itself (with and without augmentation), a sequence's first frame
// repeats, and datasets that cannot give frames are refused.
#include "data/datagen.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>

namespace parallax::data {
namespace {

using testing::expect_data_error;
using testing::small_options;
using testing::TempDir;

constexpr int64_t kFramesSeqLength = 4;

class FramesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>("frames");
    DatagenOptions o = small_options(dir_->str(), 3 * kFramesSeqLength, kFramesSeqLength, 9);
    o.gen.sequence_length = kFramesSeqLength;
    o.gen.frame_interval_us = 500000;
    generate_dataset(o);
    ds_ = Dataset::open(dir_->str(), "train");
  }
  static void TearDownTestSuite() {
    ds_.reset();
    dir_.reset();
  }
  static LoaderOptions options(bool augment) {
    LoaderOptions o;
    o.batch_size = 4;
    o.num_workers = 1;
    o.frames = 3;
    o.shuffle = false;
    o.augment = augment;
    o.seed = 5;
    return o;
  }
  static std::unique_ptr<TempDir> dir_;
  static std::shared_ptr<Dataset> ds_;
};
std::unique_ptr<TempDir> FramesTest::dir_;
std::shared_ptr<Dataset> FramesTest::ds_;

// Static boxes (velocity 0) by instance id: their centres in scene `index`'s ego frame.
std::map<int64_t, std::array<double, 2>> frames_static_boxes(const SceneRecord& r) {
  std::map<int64_t, std::array<double, 2>> out;
  for (int64_t k = 0; k < r.boxes.size(0); ++k) {
    const float* v = r.velocities.data_ptr<float>() + 2 * k;
    if (v[0] != 0 || v[1] != 0) continue;
    const float* b = r.boxes.data_ptr<float>() + k * kBoxColumns;
    out[r.instance_ids.data_ptr<int64_t>()[k]] = {b[kBoxX], b[kBoxY]};
  }
  return out;
}

TEST_F(FramesTest, PreviousFramesFollowTheSequenceAndItsStartRepeats) {
  DataLoader loader(ds_, options(false));
  const auto b = loader.next();
  ASSERT_TRUE(b.has_value());
  ASSERT_EQ(b->at("prev_images").sizes(), at::IntArrayRef({4, 2, 4, 48, 80, 3}));
  ASSERT_EQ(b->at("prev_to_current").sizes(), at::IntArrayRef({4, 2, 4, 4}));
  const at::Tensor idx = b->at("scene_index");
  for (int64_t i = 0; i < 4; ++i) {
    const int64_t scene = idx[i].item<int64_t>();
    const int64_t frame = scene % kFramesSeqLength;  // unshuffled: scenes 0..3 are frames 0..3
    for (int64_t k = 0; k < 2; ++k) {
      // Frame k + 1 back, or the sequence's first frame where there is none.
      const int64_t want = scene - std::min(k + 1, frame);
      EXPECT_EQ(b->at("prev_repeated")[i][k].item<bool>(), k + 1 > frame) << scene << " " << k;
      const SceneRecord r = ds_->read(want);
      EXPECT_TRUE(at::equal(b->at("prev_images")[i][k], r.images)) << scene << " " << k;
      EXPECT_TRUE(at::equal(b->at("prev_intrinsics")[i][k], r.intrinsics));
      EXPECT_TRUE(at::equal(b->at("prev_cam_to_ego")[i][k], r.cam_to_ego));
      if (want == scene) {
        // The current frame standing in for itself: the identity (E^-1 E in float64, stored as
        // float32: off-diagonal terms of 1e-16 at most).
        EXPECT_LT((b->at("prev_to_current")[i][k] - at::eye(4)).abs().max().item<float>(), 1e-6);
      }
    }
  }
}

// A static world point: its centre in a previous frame, moved by prev_to_current, is its centre in
// the current frame. Bound: both centres are float32 (|x| <= 26 m: 2^-24 * 32 = 1.9e-6 m each); the
// pose is float32 (rotation entries within 6e-8, the translation of <= 10 m within 6e-7), which
// moves a point at <= 26 m by 2 x 6e-8 x 26 + 6e-7 = 3.7e-6 m; with the augmentation the centres
// and poses also went through the BEV rotation in double and back to float (the same once more).
// So 2e-5 m, far below a BEV cell (0.5 m): the point lands in the same cell unless it sits within
// 2e-5 m of a cell edge.
TEST_F(FramesTest, PrevToCurrentMovesStaticPointsOntoThemselves) {
  for (bool augment : {false, true}) {
    DataLoader loader(ds_, options(augment));
    int64_t checked = 0;
    for (int64_t batch = 0; batch < loader.batches_per_epoch(); ++batch) {
      const auto b = loader.next();
      ASSERT_TRUE(b.has_value());
      for (int64_t i = 0; i < b->at("scene_index").size(0); ++i) {
        const int64_t scene = b->at("scene_index")[i].item<int64_t>();
        if (scene % kFramesSeqLength == 0) continue;
        // The loader's current frame (augmented as the batch is) against its previous one, read
        // and augmented with the same draw.
        AugmentParams p;
        p.cameras.assign(4, CameraAugment{});
        if (augment) p = draw_augment(options(true).aug, 4, 48, 80, 5, 0, scene);
        SceneRecord cur = ds_->read(scene), prev = ds_->read(scene - 1);
        if (augment) {
          cur = apply_augment(cur, p, ds_->info().bev);
          prev = apply_augment(prev, p, ds_->info().bev);
        }
        const auto now = frames_static_boxes(cur), before = frames_static_boxes(prev);
        const at::Tensor T = b->at("prev_to_current")[i][0].to(at::kDouble);
        for (const auto& [id, c] : before) {
          if (!now.count(id)) continue;
          const double x = T[0][0].item<double>() * c[0] + T[0][1].item<double>() * c[1] +
                           T[0][3].item<double>();
          const double y = T[1][0].item<double>() * c[0] + T[1][1].item<double>() * c[1] +
                           T[1][3].item<double>();
          EXPECT_NEAR(x, now.at(id)[0], 2e-5) << "scene " << scene << " instance " << id;
          EXPECT_NEAR(y, now.at(id)[1], 2e-5) << "scene " << scene << " instance " << id;
          ++checked;
        }
      }
    }
    EXPECT_GT(checked, 5) << "augment " << augment;
  }
}

TEST_F(FramesTest, DatasetsThatCannotGiveFramesAreRefused) {
  LoaderOptions o = options(false);
  o.frames = kFramesSeqLength + 1;
  expect_data_error([&] { DataLoader(ds_, o); }, {"data.frames = 5", "sequence_length"});
  TempDir plain("frames_plain");
  generate_dataset(small_options(plain.str(), 4, 1));
  expect_data_error([&] { DataLoader(Dataset::open(plain.str(), "train"), options(false)); },
                    {"data.frames = 3", "independent scenes"});
}

}  // namespace
}  // namespace parallax::data
