// Augmentation keeps images, cameras and labels consistent; checked with independent references
// (LibTorch's grid_sample and matrix inverse, formulas written from docs/data.md).
#include "data/augment.h"
#include "data/datagen.h"
#include "test_util.h"
#include "tests/common/tolerance.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

namespace parallax::data {
namespace {

using testing::project;
namespace tol = parallax::testing;
using tol::u;

// The augmented rig is computed in double and stored as float: every entry of K' and cam_to_ego'
// within u of its exact value. Projecting points p through the stored rig in double (the test's
// project()) then differs from projecting through the exact rig by, per point, in camera
// coordinates pc: |d pc| <= u |R|^T (|R| |pc| + |t|) (the inverse's first-order change
// E^-1 dE E^-1), and in pixels (f x + c z) / z: u (f m_x + c m_z + |u| m_z + f |x| + c |z|) / |z|
// (m: that camera-coordinate bound; the last two terms: K's own rounding), u doubled for the
// double arithmetic's 1e-15 relative. Returns [P, 3] bounds on (u, v, z).
at::Tensor rig_rounding(const at::Tensor& points, const at::Tensor& k,
                        const at::Tensor& cam_to_ego) {
  const at::Tensor e = cam_to_ego.to(at::kDouble), kk = k.to(at::kDouble);
  const at::Tensor r = e.slice(0, 0, 3).slice(1, 0, 3), t = e.slice(0, 0, 3).select(1, 3);
  const at::Tensor ph =
      at::cat({points.to(at::kDouble), at::ones({points.size(0), 1}, at::kDouble)}, 1);
  const at::Tensor pc = at::matmul(ph, at::inverse(e).t()).slice(1, 0, 3);
  const at::Tensor m = (pc.abs().matmul(r.abs().t()) + t.abs()).matmul(r.abs()) * (2 * u);
  const at::Tensor z = pc.select(1, 2).abs();
  auto pixel = [&](int64_t row, int64_t xyz) {
    const double f = kk[row][row].item<double>(), c = kk[row][2].item<double>();
    const at::Tensor pix = (f * pc.select(1, xyz) + c * pc.select(1, 2)) / pc.select(1, 2);
    return (f * m.select(1, xyz) + c * m.select(1, 2) + pix.abs() * m.select(1, 2) +
            2 * u * (f * pc.select(1, xyz).abs() + c * z)) /
           z;
  };
  return at::stack({pixel(0, 0), pixel(1, 1), m.select(1, 2)}, 1);
}

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
    // Exact in real arithmetic; the stored rig's rounding (rig_rounding) is the whole difference.
    const at::Tensor bound = rig_rounding(P2, a.intrinsics[k], a.cam_to_ego[k]);
    EXPECT_TRUE(tol::within(after.select(1, 0).masked_select(in_front),
                            want_u.masked_select(in_front),
                            bound.select(1, 0).masked_select(in_front)));
    EXPECT_TRUE(tol::within(after.select(1, 1).masked_select(in_front),
                            want_v.masked_select(in_front),
                            bound.select(1, 1).masked_select(in_front)));
    EXPECT_TRUE(tol::within(after.select(1, 2), before.select(1, 2), bound.select(1, 2)));
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
    // The output is the double bilinear value rounded to an integer (0.5); both sides compute tap
    // positions and weights in double (positions within 16 u64 W pixels, values <= 255 moving by
    // at most 2 * 255 per pixel per axis) and 4-tap sums (gamma64(8) of 255): ~1e-10 in all.
    const at::Tensor diff = (a.images[k].to(at::kDouble) - ref).abs();
    const double slack =
        255 * (4 * 16 * tol::kFp64Unit * static_cast<double>(W) + tol::gamma_k(8, tol::kFp64Unit));
    EXPECT_LE(diff.max().item<double>(), 0.5 + slack) << "camera " << k;
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
      // The library moves the centre in double and stores it as a float (u per coordinate); z is
      // copied.
      EXPECT_LT(d[src].item<double>(),
                tol::gamma_k(2) * moved[src].slice(0, 0, 2).norm().item<double>());
      const double yaw0 = s.boxes[src][kBoxYaw].item<float>(),
                   yaw1 = a.boxes[k][kBoxYaw].item<float>();
      const double want = (flip ? -yaw0 : yaw0) + rot;
      // The yaw computed and wrapped in double, stored as a float (|yaw| <= pi): u pi.
      EXPECT_NEAR(std::remainder(yaw1 - want, 2 * M_PI), 0.0, tol::gamma_k(4));
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

// A box's velocity turns with the BEV transform (row for row with the kept boxes, NaN staying
// NaN), and the ego pose changes so that every point keeps its global position.
TEST_F(AugmentTest, BevTransformTurnsVelocitiesAndKeepsGlobalPositions) {
  SceneRecord s = *scene_;
  const int64_t K = s.boxes.size(0);
  ASSERT_GT(K, 3);
  at::manual_seed(5);
  s.velocities = at::rand({K, 2}) * 16 - 8;
  s.velocities[1][0] = NAN;
  at::Tensor pose = at::eye(4, at::kDouble);
  pose[0][0] = std::cos(0.7);
  pose[0][1] = -std::sin(0.7);
  pose[1][0] = std::sin(0.7);
  pose[1][1] = std::cos(0.7);
  pose[0][3] = 412.5;
  pose[1][3] = -1033.25;
  s.ego_to_global = pose;
  const BevGrid g;
  for (auto [rot, flip] : {std::pair{0.0, true}, std::pair{0.3, false}, std::pair{-0.2, true}}) {
    const SceneRecord a = apply_augment(s, params(1.0, 0, 0, rot, flip), g);
    ASSERT_TRUE(a.velocities.defined());
    ASSERT_EQ(a.velocities.sizes(), at::IntArrayRef({a.boxes.size(0), 2}));
    const at::Tensor A = bev_matrix(rot, flip);
    const at::Tensor moved = at::matmul(s.boxes.slice(1, 0, 3).to(at::kDouble), A.t());
    for (int64_t k = 0; k < a.boxes.size(0); ++k) {
      const int64_t src =
          (moved - a.boxes[k].slice(0, 0, 3).to(at::kDouble)).norm(2, 1).argmin().item<int64_t>();
      const at::Tensor v0 = s.velocities[src].to(at::kDouble);
      if (at::isnan(v0).any().item<bool>()) {
        // vx unknown: the turned vector mixes it into both components unless A keeps axes apart.
        EXPECT_TRUE(at::isnan(a.velocities[k]).any().item<bool>()) << k;
        continue;
      }
      const at::Tensor want = at::matmul(A.slice(0, 0, 2).slice(1, 0, 2), v0);
      // Turned in double and stored as float: within u |v| per component (|v| <= 8 sqrt 2), plus
      // the rotation's 2 products and sum in double.
      EXPECT_TRUE(tol::within(a.velocities[k].to(at::kDouble), want,
                              at::full({2}, tol::gamma_k(2) * 12, at::kDouble)))
          << a.velocities[k] << want;
    }
    // Global positions: ego_to_global' (A p) = ego_to_global p, for p a box centre, within the
    // double arithmetic on coordinates up to ~1100 m (2^-52 relative per operation, 12 of them).
    ASSERT_TRUE(a.ego_to_global.defined());
    const at::Tensor p = at::tensor({12.5, -7.25, 1.0, 1.0}, at::kDouble);
    const at::Tensor pa = at::matmul(at::block_diag({A, at::ones({1, 1}, at::kDouble)}), p);
    const at::Tensor before = at::matmul(pose, p), after = at::matmul(a.ego_to_global, pa);
    EXPECT_LT((before - after).abs().max().item<double>(), 12 * 1100 * 2.3e-16) << before << after;
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
  // The library composes the same affine map in double through YIQ (the exact cofactor inverse,
  // condition < 10) and rounds to an integer (0.5); both sides' double arithmetic on values <= 255
  // stays within 1e-12 (255 x 4 products of 3 x 3 matrices x 64 u64), so 1e-9 covers it.
  EXPECT_LE((out.to(at::kDouble) - ref).abs().max().item<double>(), 0.5 + 1e-9);

  // A hue rotation keeps grey pixels grey and the luma of every pixel.
  CameraAugment h;
  h.hue_rad = 0.4;
  at::Tensor grey = at::randint(0, 256, {H, W, 1}, at::kByte).expand({H, W, 3}).contiguous();
  at::Tensor g = grey.clone();
  photometric(g.data_ptr<uint8_t>(), H, W, h);
  // Exact: a grey pixel has I = Q = 0 up to 1e-12 in double, so it rounds back to its value.
  EXPECT_TRUE(at::equal(g, grey));
  at::Tensor col = at::randint(40, 200, {H, W, 3}, at::kByte);
  at::Tensor hc = col.clone();
  photometric(hc.data_ptr<uint8_t>(), H, W, h);
  const at::Tensor y0 = (col.to(at::kDouble) * wts).sum(2), y1 = (hc.to(at::kDouble) * wts).sum(2);
  // The rotation keeps Y exactly; each channel is rounded to an integer (0.5 each, weights summing
  // to 1), unless it clamps at 0 or 255: where no output channel sits at a bound, the luma moves by
  // at most 0.5 (+ the double arithmetic's 1e-12).
  const at::Tensor unclamped = ((hc > 0) & (hc < 255)).all(2);
  ASSERT_GT(unclamped.sum().item<int64_t>(), H * W / 2);
  EXPECT_LE((y0 - y1).abs().masked_select(unclamped).max().item<double>(), 0.5 + 1e-9);
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
