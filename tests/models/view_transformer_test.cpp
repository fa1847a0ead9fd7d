// The view transformer's sampling step must read image features exactly where the BEV reference
// points project, and nowhere else.
#include "models/view_transformer.h"
#include "kernels/bev_sample.h"
#include "models/camera_rig.h"
#include "models/geometry.h"
#include "tests/common/tolerance.h"
#include "tests/kernels/bev_sample_bound.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

namespace parallax::models {
namespace {

namespace tol = parallax::testing;
namespace bounds = parallax::kernels::testing;

constexpr int64_t kH = 128, kW = 224, kStride = 8, kC = 5;

ViewTransformerOptions options() {
  ViewTransformerOptions o;
  o.in_channels = o.channels = kC;
  o.heights = {0.0, 0.6, 1.2, 1.8};
  o.grid = {-25, -25, 1.0, 50, 50};
  o.image_h = kH;
  o.image_w = kW;
  return o;
}

TEST(ViewTransformerTest, ReferencePointsAreCellCentresAtEachHeight) {
  ViewTransformer vt(options());
  // Exact: x_min + (i + 0.5) res with x_min = -25 and res = 1 are halves, and the heights are the
  // configured doubles rounded to float once.
  const at::Tensor p = vt->reference_points(at::kCPU).view({4, 50, 50, 3});
  EXPECT_EQ(p[0][0][0][0].item<float>(), -24.5f);
  EXPECT_EQ(p[0][0][0][1].item<float>(), -24.5f);
  EXPECT_EQ(p[2][49][3][0].item<float>(), 24.5f);
  EXPECT_EQ(p[2][49][3][1].item<float>(), -21.5f);
  EXPECT_EQ(p[2][49][3][2].item<float>(), 1.2f);
}

TEST(ViewTransformerTest, OccupiedCellIsSampledFromTheRightCameraPixel) {
  at::manual_seed(5);
  ViewTransformer vt(options());
  const CameraRig rig = make_surround_rig({6, kH, kW});
  const at::Tensor k = rig.intrinsics.unsqueeze(0), e = rig.cam_to_ego.unsqueeze(0);
  // Camera 1 looks along yaw 60 degrees; take the cell ~12 m along its axis, at height index 1.
  const double yaw = std::numbers::pi / 3;
  const int64_t ci = static_cast<int64_t>(std::floor(12 * std::cos(yaw) + 25));
  const int64_t cj = static_cast<int64_t>(std::floor(12 * std::sin(yaw) + 25));
  const int64_t zi = 1, cam = 1;
  const at::Tensor point =
      at::tensor({-25 + ci + 0.5, -25 + cj + 0.5, 0.6}, at::kFloat).view({1, 3});
  const Projection proj = project_points(point, k, e);
  ASSERT_EQ(visibility_mask(proj, kH, kW)[0].select(1, 0).nonzero().numel(), 1)
      << "only camera 1 may see it";
  // The pixel as the model projects it: the same call on all reference points, so the very same
  // fp32 values (the point is reference point (zi, ci * 50 + cj)).
  const at::Tensor ref_points = vt->reference_points(at::kCPU);
  ASSERT_TRUE(at::equal(ref_points[zi * 2500 + ci * 50 + cj], point[0]));
  const Projection all = project_points(ref_points, k, e);
  const at::Tensor pix = all.uv[0][cam][zi * 2500 + ci * 50 + cj];
  const double u = pix[0].item<double>(), v = pix[1].item<double>();

  // Feature maps are zero except a distinctive random vector at the feature pixel holding (u, v).
  const int64_t fh = kH / kStride, fw = kW / kStride;
  at::Tensor feats = at::zeros({6, kC, fh, fw});
  const int64_t px = static_cast<int64_t>(u / kStride), py = static_cast<int64_t>(v / kStride);
  const at::Tensor signal = at::rand({kC}) + 1;
  feats[cam].select(1, py).select(1, px).copy_(signal);

  const auto s = vt->sample(feats, k, e);
  ASSERT_EQ(s.features.sizes(), at::IntArrayRef({1, kC, 4, 2500}));
  // Bilinear weight of that pixel at the projection (align_corners=false: centres at i + 0.5).
  const double wx = 1 - std::abs(u / kStride - 0.5 - static_cast<double>(px));
  const double wy = 1 - std::abs(v / kStride - 0.5 - static_cast<double>(py));
  const int64_t q = ci * 50 + cj;
  EXPECT_EQ(s.count[0][zi][q].item<float>(), 1.0f);
  const at::Tensor got = s.features[0].select(1, zi).select(1, q);
  // The model's tap position is within coord_error() of the one the test computes from the same
  // fp32 (u, v) in double (bev_sample_bound.h): the weight wx wy moves by at most 2 coord, and
  // its products and the one-camera mean round 6 times.
  const double coord = bounds::coord_error(fh, fw, tol::kFp32Unit);
  const at::Tensor want = signal.to(at::kDouble) * (wx * wy);
  EXPECT_TRUE(tol::within(got, want, signal.to(at::kDouble) * (2 * coord + tol::gamma_k(6))))
      << got << want;

  // Cells outside camera 1's field of view (more than 36 degrees off its axis, seen from the
  // camera centre) receive nothing at any height; neither do cells far from the ray.
  const at::Tensor pts = vt->reference_points(at::kCPU).view({4, 2500, 3});
  const at::Tensor centre = rig.cam_to_ego[cam].narrow(0, 0, 3).select(1, 3);
  const at::Tensor rel = pts.select(-1, 0) - centre[0], rely = pts.select(-1, 1) - centre[1];
  at::Tensor off_axis = at::atan2(rely, rel) - yaw;
  off_axis = at::atan2(off_axis.sin(), off_axis.cos()).abs();  // [4, 2500]
  const at::Tensor energy = s.features[0].abs().sum(0);        // [4, 2500]
  const at::Tensor unseen = off_axis > 36.0 * std::numbers::pi / 180.0;
  ASSERT_GT(unseen.sum().item<int64_t>(), 4 * 1500);
  EXPECT_EQ(energy.masked_select(unseen).abs().max().item<float>(), 0.0f);
  // The lit pixel is 8 px wide (2.9 degrees at f = 160 px); bilinear sampling reaches it from up
  // to 12 px away (4.3 degrees); cells more than 6 degrees off the point's bearing stay dark.
  const double bearing = std::atan2(point[0][1].item<double>() - centre[1].item<double>(),
                                    point[0][0].item<double>() - centre[0].item<double>());
  at::Tensor off_point = at::atan2(rely, rel) - bearing;
  off_point = at::atan2(off_point.sin(), off_point.cos()).abs();
  EXPECT_EQ(energy.masked_select(off_point > 6.0 * std::numbers::pi / 180.0).max().item<float>(),
            0.0f);
  EXPECT_GT(energy.gt(0).sum().item<int64_t>(), 0);
}

TEST(ViewTransformerTest, MeanOverCamerasThatSeeAPoint) {
  // Constant feature value per camera: a point seen by cameras a and b gets their mean.
  ViewTransformer vt(options());
  const CameraRig rig = make_surround_rig({6, kH, kW});
  const at::Tensor k = rig.intrinsics.unsqueeze(0), e = rig.cam_to_ego.unsqueeze(0);
  const at::Tensor value = at::arange(1, 7, at::kFloat);  // camera c has value c + 1
  const at::Tensor feats =
      value.view({6, 1, 1, 1}).expand({6, kC, kH / kStride, kW / kStride}).contiguous();
  const auto s = vt->sample(feats, k, e);
  const Projection proj = project_points(vt->reference_points(at::kCPU), k, e);
  const at::Tensor vis = visibility_mask(proj, kH, kW)[0].to(at::kFloat);  // [6, Z*Q]
  // Where a point is well inside the images, its bilinear weights sum to 1 (each computed with 2
  // roundings, their products with the constant 2 more, the 4-tap sum 3) and the mean over up to
  // 6 cameras adds 6 roundings: within gamma(13) of the exact mean of the constants (<= 6).
  const at::Tensor u = proj.uv[0].select(-1, 0), v = proj.uv[0].select(-1, 1);
  const at::Tensor inner = (u > kStride) & (u < kW - kStride) & (v > kStride) & (v < kH - kStride);
  const at::Tensor inner_or_unseen = (inner | (vis == 0)).all(0);
  const at::Tensor count = vis.sum(0);
  const at::Tensor expect = (vis * value.view({6, 1})).sum(0) / count.clamp_min(1);
  const at::Tensor got = s.features[0][0].reshape({-1});
  const at::Tensor sel = inner_or_unseen & (count > 0);
  ASSERT_GT((sel & (count > 1)).sum().item<int64_t>(), 10)
      << "the test needs points in camera overlaps";
  EXPECT_TRUE(tol::within(got.masked_select(sel), expect.masked_select(sel), 6 * tol::gamma_k(13)));
  EXPECT_TRUE(at::equal(s.count[0].reshape({-1}), count));
}

TEST(ViewTransformerTest, KernelReferencePathMatchesCompactedSample) {
  // kernels::bev_sample's ATen path (the reference of the fused CUDA kernels that forward() runs
  // on GPUs) must mean what the model's compacted sample() means: same per-camera means, counts
  // and seen flags for the projected reference points, and the same feature gradients.
  at::manual_seed(6);
  ViewTransformer vt(options());
  const int64_t b = 2, n = 6, z = 4, q = 2500;
  const CameraRig rig = jitter_rig(make_surround_rig({n, kH, kW}), b);  // the samples differ
  const at::Tensor features = at::randn({b * n, kC, kH / kStride, kW / kStride});
  at::Tensor f_model = features.clone().requires_grad_(true),
             f_kernel = features.clone().requires_grad_(true);

  const auto s = vt->sample(f_model, rig.intrinsics, rig.cam_to_ego);
  const Projection proj =
      project_points(vt->reference_points(at::kCPU), rig.intrinsics, rig.cam_to_ego);
  const at::Tensor visible = visibility_mask(proj, kH, kW);
  const kernels::BevSample k =
      kernels::bev_sample(f_kernel, proj.uv, visible, z, kH, kW, /*fused=*/false);
  ASSERT_EQ(k.lifted.sizes(), at::IntArrayRef({b, kC * z + z, q}));
  ASSERT_TRUE((s.count > 1).any().item<bool>() && (s.count == 0).any().item<bool>());

  // lifted[b, c*Z + z, q] is s.features[b, c, z, q]; lifted[b, C*Z + z, q] is s.count > 0.
  const at::Tensor mean = k.lifted.narrow(1, 0, kC * z).view({b, kC, z, q});
  const at::Tensor seen = k.lifted.narrow(1, kC * z, z).view({b, z, q});
  // Two fp32 evaluations of the same means (scatter_add vs dense sums), each within lifted_bound()
  // of exact (bev_sample_bound.h).
  EXPECT_TRUE(tol::within(mean, s.features, 2 * bounds::lifted_bound(features, n, tol::kFp32Unit)));
  EXPECT_TRUE(at::equal(k.count.view({b, z, q}), s.count));
  EXPECT_TRUE(at::equal(seen, (s.count > 0).to(at::kFloat)));
  EXPECT_GT(s.features.abs().max().item<float>(), 0.1f);

  const at::Tensor w = at::randn({b, kC, z, q});
  (s.features * w).sum().backward();
  (mean * w).sum().backward();
  const at::Tensor& g = f_model.grad();
  ASSERT_GT(g.abs().max().item<double>(), 0.0);
  // Two fp32 evaluations, each within gradient_bound() of exact (per pixel, from its
  // contributions), with the upstream in lifted's layout (zero on the seen flags).
  const at::Tensor w_lifted = at::cat({w.view({b, kC * z, q}), at::zeros({b, z, q})}, 1);
  const at::Tensor bound =
      2 * bounds::gradient_bound(features, proj.uv, visible, w_lifted, z, kH, kW, tol::kFp32Unit);
  EXPECT_TRUE(tol::within(f_kernel.grad(), g, bound));
}

}  // namespace
}  // namespace parallax::models
