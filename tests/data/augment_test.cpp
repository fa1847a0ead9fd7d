// Augmentation keeps images, cameras and labels consistent; checked with independent references
// (LibTorch's grid_sample and matrix inverse, formulas written from docs/data.md).
#include "data/augment.h"
#include "data/datagen.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

namespace parallax::data {
namespace {

using testing::project;

class AugmentTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    GeneratorOptions o;
    o.cameras = 4;
    o.height = 64;
    o.width = 112;
    scene_ = new SceneRecord(generate_scene(o, 21, 2).record);
  }
  static void TearDownTestSuite() {
    delete scene_;
    scene_ = nullptr;
  }
  static AugmentParams params(double scale, double ox, double oy, double rot, bool flip) {
    AugmentParams p;
    p.rotation_rad = rot;
    p.flip_y = flip;
    for (int k = 0; k < 4; ++k) p.cameras.push_back({scale + 0.02 * k, ox + k, oy - k, 1, 1, 1, 0});
    return p;
  }
  static SceneRecord* scene_;
};
SceneRecord* AugmentTest::scene_ = nullptr;

at::Tensor bev_matrix(double rot, bool flip) {
  at::Tensor A = at::eye(3, at::kDouble);
  A[0][0] = std::cos(rot);
  A[0][1] = -std::sin(rot);
  A[1][0] = std::sin(rot);
  A[1][1] = std::cos(rot);
  if (flip) A = at::matmul(A, at::diag(at::tensor({1.0, -1.0, 1.0}, at::kDouble)));
  return A;
}

TEST_F(AugmentTest, ProjectionThroughNewCamerasMatchesTheResizedCrop) {
  const SceneRecord& s = *scene_;
  const AugmentParams p = params(1.1, 6, 3, 0.3, true);
  const SceneRecord a = apply_augment(s, p, BevGrid{});
  const at::Tensor A = bev_matrix(0.3, true);
  // Box corners and centres of the original scene, and the same points moved by the BEV transform.
  const at::Tensor P = s.boxes.slice(1, 0, 3).to(at::kDouble);
  const at::Tensor P2 = at::matmul(P, A.t());
  int checked = 0;
  for (int64_t k = 0; k < 4; ++k) {
    const auto& c = p.cameras[static_cast<size_t>(k)];
    const at::Tensor before = project(P, s.intrinsics[k], s.cam_to_ego[k]);
    const at::Tensor after = project(P2, a.intrinsics[k], a.cam_to_ego[k]);
    const at::Tensor in_front = before.select(1, 2) > 0.5;
    const at::Tensor want_u = before.select(1, 0) * c.scale - c.ox,
                     want_v = before.select(1, 1) * c.scale - c.oy;
    EXPECT_TRUE(at::allclose(after.select(1, 0).masked_select(in_front),
                             want_u.masked_select(in_front), 0, 2e-3));
    EXPECT_TRUE(at::allclose(after.select(1, 1).masked_select(in_front),
                             want_v.masked_select(in_front), 0, 2e-3));
    EXPECT_TRUE(at::allclose(after.select(1, 2), before.select(1, 2), 0, 1e-4));
    checked += static_cast<int>(in_front.sum().item<int64_t>());
  }
  EXPECT_GT(checked, 10);
}

TEST_F(AugmentTest, ResampledImagesShowTheSameContentAsGridSample) {
  const SceneRecord& s = *scene_;
  const AugmentParams p = params(1.13, 9, 4, 0.0, false);
  const SceneRecord a = apply_augment(s, p, BevGrid{});
  const int64_t H = s.images.size(1), W = s.images.size(2);
  for (int64_t k = 0; k < 4; ++k) {
    const auto& c = p.cameras[static_cast<size_t>(k)];
    // Source point of output pixel centre (i + 0.5, j + 0.5): ((i + 0.5 + ox) / s, (j + 0.5 + oy) /
    // s), normalised for grid_sample(align_corners=false) as 2 u / W - 1.
    const at::Tensor ii = at::arange(W, at::kDouble), jj = at::arange(H, at::kDouble);
    const at::Tensor u = (ii + 0.5 + c.ox) / c.scale, v = (jj + 0.5 + c.oy) / c.scale;
    const at::Tensor gx = (2 * u / W - 1).unsqueeze(0).expand({H, W});
    const at::Tensor gy = (2 * v / H - 1).unsqueeze(1).expand({H, W});
    const at::Tensor grid = at::stack({gx, gy}, 2).unsqueeze(0);
    const at::Tensor src = s.images[k].permute({2, 0, 1}).unsqueeze(0).to(at::kDouble);
    const at::Tensor ref = at::grid_sampler(src, grid, 0, 0, false).squeeze(0).permute({1, 2, 0});
    const at::Tensor diff = (a.images[k].to(at::kDouble) - ref).abs();
    EXPECT_LE(diff.max().item<double>(), 0.5 + 1e-6) << "camera " << k;
  }
}

TEST_F(AugmentTest, IdentityParametersChangeNothing) {
  const SceneRecord& s = *scene_;
  AugmentParams p;
  p.cameras.assign(4, CameraAugment{});
  const SceneRecord a = apply_augment(s, p, BevGrid{});
  EXPECT_TRUE(at::equal(a.images, s.images));
  EXPECT_TRUE(at::equal(a.intrinsics, s.intrinsics));
  EXPECT_TRUE(at::equal(a.cam_to_ego, s.cam_to_ego));
  EXPECT_TRUE(at::equal(a.bev_semantics, s.bev_semantics));
  EXPECT_TRUE(at::equal(a.boxes, s.boxes));
}

TEST_F(AugmentTest, BevTransformMovesBoxesWithTheirCells) {
  const SceneRecord& s = *scene_;
  const BevGrid g;
  for (auto [rot, flip] : {std::pair{0.0, true}, std::pair{0.3, false}, std::pair{-0.2, true}}) {
    const SceneRecord a =
        apply_augment(s, params(1.0, 0, 0, rot, flip), g, box_to_bev_classes(DatasetInfo{}));
    ASSERT_GT(a.boxes.size(0), 3);
    const at::Tensor A = bev_matrix(rot, flip);
    int inside = 0, agree = 0;
    const auto sem = a.bev_semantics.accessor<uint8_t, 2>();
    // Every kept box is the transform of an original box.
    const at::Tensor moved = at::matmul(s.boxes.slice(1, 0, 3).to(at::kDouble), A.t());
    for (int64_t k = 0; k < a.boxes.size(0); ++k) {
      const at::Tensor d = (moved - a.boxes[k].slice(0, 0, 3).to(at::kDouble)).norm(2, 1);
      const int64_t src = d.argmin().item<int64_t>();
      EXPECT_LT(d[src].item<double>(), 1e-4);
      const double yaw0 = s.boxes[src][kBoxYaw].item<float>(),
                   yaw1 = a.boxes[k][kBoxYaw].item<float>();
      const double want = (flip ? -yaw0 : yaw0) + rot;
      EXPECT_NEAR(std::remainder(yaw1 - want, 2 * M_PI), 0.0, 1e-5);
      EXPECT_EQ(a.boxes[k][kBoxClass].item<float>(), s.boxes[src][kBoxClass].item<float>());
      // Cells under the moved footprint carry the box's class, and the cell holding the moved
      // centre does (the object rule is applied again after resampling).
      const double x = a.boxes[k][0].item<float>(), y = a.boxes[k][1].item<float>();
      const double l = a.boxes[k][3].item<float>(), w = a.boxes[k][4].item<float>();
      const int64_t cls = 3 + static_cast<int64_t>(a.boxes[k][kBoxClass].item<float>());
      bool near_centre = false;
      for (int64_t i = 0; i < g.x_cells(); ++i) {
        for (int64_t j = 0; j < g.y_cells(); ++j) {
          const double cx = g.x_min + (i + 0.5) * g.resolution - x,
                       cy = g.y_min + (j + 0.5) * g.resolution - y;
          const double lx = std::cos(yaw1) * cx + std::sin(yaw1) * cy,
                       ly = -std::sin(yaw1) * cx + std::cos(yaw1) * cy;
          const bool has = sem[i][j] == cls;
          if (std::abs(lx) <= l / 2 && std::abs(ly) <= w / 2) {
            ++inside;
            agree += has ? 1 : 0;
          }
          const bool centre_cell = cx > -0.5 * g.resolution && cx <= 0.5 * g.resolution &&
                                   cy > -0.5 * g.resolution && cy <= 0.5 * g.resolution;
          if (centre_cell) near_centre = has;
        }
      }
      EXPECT_TRUE(near_centre) << "box " << k << " rot " << rot << " flip " << flip;
    }
    EXPECT_EQ(agree, inside) << "rot " << rot << " flip " << flip;
    if (rot == 0.0) {
      // A pure flip is an exact permutation of the grid.
      EXPECT_TRUE(at::equal(a.bev_semantics, s.bev_semantics.flip({1})));
    }
  }
}

TEST(PhotometricTest, MatchesTheReferenceFormulas) {
  at::manual_seed(3);
  const int64_t H = 16, W = 24;
  const at::Tensor img = at::randint(0, 256, {H, W, 3}, at::kByte);
  CameraAugment c;
  c.brightness = 1.15;
  c.contrast = 0.85;
  c.saturation = 1.2;
  at::Tensor out = img.clone();
  photometric(out.data_ptr<uint8_t>(), H, W, c);
  // torchvision-style: brightness scales, contrast blends with the mean grey, saturation blends
  // with the per-pixel grey (grey = 0.299 r + 0.587 g + 0.114 b).
  const at::Tensor wts = at::tensor({0.299, 0.587, 0.114}, at::kDouble);
  const at::Tensor x = img.to(at::kDouble);
  const at::Tensor x1 = x * 1.15;
  const at::Tensor m = (x1 * wts).sum(2).mean();
  const at::Tensor x2 = x1 * 0.85 + m * 0.15;
  const at::Tensor g2 = (x2 * wts).sum(2, true);
  const at::Tensor ref = (x2 * 1.2 + g2 * (1 - 1.2)).clamp(0, 255);
  EXPECT_LE((out.to(at::kDouble) - ref).abs().max().item<double>(), 0.5 + 1e-6);

  // A hue rotation keeps grey pixels grey and the luma of every pixel.
  CameraAugment h;
  h.hue_rad = 0.4;
  at::Tensor grey = at::randint(0, 256, {H, W, 1}, at::kByte).expand({H, W, 3}).contiguous();
  at::Tensor g = grey.clone();
  photometric(g.data_ptr<uint8_t>(), H, W, h);
  EXPECT_LE((g.to(at::kInt) - grey.to(at::kInt)).abs().max().item<int>(), 1);
  at::Tensor col = at::randint(40, 200, {H, W, 3}, at::kByte);
  at::Tensor hc = col.clone();
  photometric(hc.data_ptr<uint8_t>(), H, W, h);
  const at::Tensor y0 = (col.to(at::kDouble) * wts).sum(2), y1 = (hc.to(at::kDouble) * wts).sum(2);
  EXPECT_LE((y0 - y1).abs().max().item<double>(), 1.0);
  EXPECT_GT((hc.to(at::kInt) - col.to(at::kInt)).abs().max().item<int>(), 5);
}

TEST(AugmentDrawTest, DeterministicPerSeedEpochAndScene) {
  AugmentOptions o;
  const auto a = draw_augment(o, 6, 128, 224, 7, 2, 31), b = draw_augment(o, 6, 128, 224, 7, 2, 31);
  const auto c = draw_augment(o, 6, 128, 224, 7, 3, 31), d = draw_augment(o, 6, 128, 224, 7, 2, 32);
  EXPECT_EQ(a.rotation_rad, b.rotation_rad);
  EXPECT_EQ(a.cameras[5].scale, b.cameras[5].scale);
  EXPECT_EQ(a.cameras[5].hue_rad, b.cameras[5].hue_rad);
  EXPECT_NE(a.rotation_rad, c.rotation_rad);
  EXPECT_NE(a.rotation_rad, d.rotation_rad);
  for (const auto& cam : a.cameras) {
    EXPECT_GE(cam.scale, o.resize_min);
    EXPECT_LT(cam.scale, o.resize_max);
    EXPECT_EQ(cam.ox, std::round(cam.ox));
    const double ex =
        cam.scale * 224 - 224;  // crops stay within the resized image (or its padding)
    EXPECT_GE(cam.ox, std::min(0.0, ex) - 0.5);
    EXPECT_LE(cam.ox, std::max(0.0, ex) + 0.5);
  }
  EXPECT_LE(std::abs(a.rotation_rad), o.rotate_deg * M_PI / 180);
}

}  // namespace
}  // namespace parallax::data
