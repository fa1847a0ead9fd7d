// kernels::bev_sample's ATen path (what every CPU build runs, and the reference the CUDA kernels
// are tested against in bev_sample_cuda_test.cpp) against independent references: bilinear taps
// written out by hand (grid_sample's align_corners=false, zero-padding convention: feature pixel
// centres at i + 0.5 in feature units), and a float64 autograd composition that samples only the
// points each camera sees. Also the channel layout of `lifted`, the camera mean, the seen flags,
// the counts, the dtype contract, and the shape errors.
#include "kernels/bev_sample.h"

#include "core/error.h"
#include "tests/common/tolerance.h"
#include "tests/kernels/bev_sample_bound.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace parallax::kernels {
namespace {

namespace tol = parallax::testing;
using testing::coord_error;
using testing::gradient_bound;
using testing::lifted_bound;
using testing::Tap;
using testing::taps;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct HandResult {
  at::Tensor lifted;  // float64 [B, C*Z + Z, Q]
  at::Tensor count;   // float64 [B, P]
};

// The contract of bev_sample written as loops, in float64.
HandResult hand_reference(const at::Tensor& features, const at::Tensor& uv,
                          const at::Tensor& visible, int64_t z, int64_t image_h, int64_t image_w) {
  const int64_t b = uv.size(0), n = uv.size(1), p = uv.size(2), q = p / z;
  const int64_t c = features.size(1), fh = features.size(2), fw = features.size(3);
  const at::Tensor f64 = features.to(at::kDouble).contiguous(),
                   uv64 = uv.to(at::kDouble).contiguous();
  const auto f = f64.accessor<double, 4>();
  const auto pix = uv64.accessor<double, 4>();
  const at::Tensor vis_cpu = visible.contiguous();
  const auto vis = vis_cpu.accessor<bool, 3>();
  at::Tensor lifted = at::zeros({b, c * z + z, q}, at::kDouble),
             count = at::zeros({b, p}, at::kDouble);
  auto out = lifted.accessor<double, 3>();
  auto cnt = count.accessor<double, 2>();
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t pi = 0; pi < p; ++pi) {
      const int64_t zi = pi / q, qi = pi % q;
      std::vector<double> sum(static_cast<size_t>(c), 0.0);
      int64_t seen_by = 0;
      for (int64_t cam = 0; cam < n; ++cam) {
        if (!vis[bi][cam][pi]) continue;
        ++seen_by;
        for (const Tap& t :
             taps(pix[bi][cam][pi][0], pix[bi][cam][pi][1], fh, fw, image_h, image_w)) {
          for (int64_t ci = 0; ci < c; ++ci)
            sum[static_cast<size_t>(ci)] += t.w * f[bi * n + cam][ci][t.y][t.x];
        }
      }
      cnt[bi][pi] = static_cast<double>(seen_by);
      for (int64_t ci = 0; ci < c; ++ci) {
        out[bi][ci * z + zi][qi] =
            seen_by > 0 ? sum[static_cast<size_t>(ci)] / static_cast<double>(seen_by) : 0.0;
      }
      out[bi][c * z + zi][qi] = seen_by > 0 ? 1.0 : 0.0;
    }
  }
  return {lifted, count};
}

// A float64 autograd composition, independent of bev_sample's: per (sample, camera) grid_sample
// of only the points that camera sees (so inf/NaN projections of unseen points are never read),
// index_add into the sample's accumulator, divided by the count.
at::Tensor autograd_reference(const at::Tensor& features64, const at::Tensor& uv,
                              const at::Tensor& visible, int64_t z, int64_t image_h,
                              int64_t image_w) {
  const int64_t b = uv.size(0), n = uv.size(1), p = uv.size(2), q = p / z, c = features64.size(1);
  std::vector<at::Tensor> per_sample;
  for (int64_t bi = 0; bi < b; ++bi) {
    at::Tensor acc = at::zeros({c, p}, features64.options());
    for (int64_t cam = 0; cam < n; ++cam) {
      const at::Tensor idx = visible[bi][cam].nonzero().squeeze(1);
      if (idx.numel() == 0) continue;
      const at::Tensor pix = uv[bi][cam].index_select(0, idx).to(at::kDouble);  // [M, 2]
      const at::Tensor grid =
          at::stack({pix.select(1, 0) * (2.0 / static_cast<double>(image_w)) - 1,
                     pix.select(1, 1) * (2.0 / static_cast<double>(image_h)) - 1},
                    -1)
              .view({1, 1, -1, 2});
      const at::Tensor s =
          at::grid_sampler(features64[bi * n + cam].unsqueeze(0), grid, 0, 0, false);  // [1,C,1,M]
      acc = acc.index_add(1, idx, s.view({c, -1}));
    }
    per_sample.push_back(acc);
  }
  const at::Tensor count = visible.to(at::kDouble).sum(1);  // [B, P]
  const at::Tensor mean = at::stack(per_sample) / count.clamp_min(1).unsqueeze(1);
  return at::cat({mean.view({b, c * z, q}), (count > 0).to(at::kDouble).view({b, z, q})}, 1);
}

// The hand-checked case: B = 2 samples, N = 2 cameras, C = 3 channels, a 4 x 6 feature map
// covering an 8 x 12 image (stride 2 both ways), Z = 2 heights of Q = 3 cells (P = 6, p = z*Q + q).
constexpr int64_t kB = 2, kN = 2, kC = 3, kFh = 4, kFw = 6, kImgH = 8, kImgW = 12, kZ = 2, kQ = 3,
                  kP = kZ * kQ;

struct Inputs {
  at::Tensor features, uv, visible;
};

Inputs hand_inputs() {
  // {u, v, visible} per (camera, point) of sample 0.
  struct Pt {
    double u, v;
    bool seen;
  };
  const Pt cam0[kP] = {
      {5.5, 3.5, true},       // p0 (z0, q0): inside, x = 2.25, y = 1.25
      {7.0, 2.5, true},       // p1 (z0, q1): x = 3.0, y = 0.75; also seen by camera 1
      {6.0, 4.0, false},      // p2 (z0, q2): in the map but seen by no camera
      {-kInf, -kInf, false},  // p3 (z1, q0): behind camera 0
      {11.5, 0.5, true},      // p4 (z1, q1): top-right corner, x = 5.25, y = -0.25: 3 taps padded
      {3.0, 5.0, true},       // p5 (z1, q2): exactly on a feature pixel centre (x = 1, y = 2)
  };
  const Pt cam1[kP] = {
      {kInf, 2.0, false},   // p0: behind camera 1
      {2.5, 5.0, true},     // p1: x = 0.75, y = 2.0
      {kNaN, kNaN, false},  // p2
      {0.5, 7.5, true},     // p3: bottom-left corner, x = -0.25, y = 3.25: 3 taps padded
      {6.0, 4.0, false},    // p4: in the map, not seen
      {9.0, 1.0, true},     // p5: x = 4.0, y = 0.0
  };
  at::Tensor uv = at::empty({kB, kN, kP, 2}, at::kFloat),
             visible = at::empty({kB, kN, kP}, at::kBool);
  for (int64_t p = 0; p < kP; ++p) {
    for (int64_t cam = 0; cam < kN; ++cam) {
      const Pt& pt = cam == 0 ? cam0[p] : cam1[p];
      // Sample 1 swaps the cameras, so its means read the other feature maps.
      for (int64_t b = 0; b < kB; ++b) {
        const int64_t slot = b == 0 ? cam : 1 - cam;
        uv[b][slot][p][0] = pt.u;
        uv[b][slot][p][1] = pt.v;
        visible[b][slot][p] = pt.seen;
      }
    }
  }
  return {at::randn({kB * kN, kC, kFh, kFw}), uv, visible};
}

TEST(BevSampleTest, HandCheckedBilinearMeanSeenAndCount) {
  at::manual_seed(11);
  const Inputs in = hand_inputs();
  const BevSample s = bev_sample(in.features, in.uv, in.visible, kZ, kImgH, kImgW, /*fused=*/false);
  ASSERT_EQ(s.lifted.sizes(), at::IntArrayRef({kB, kC * kZ + kZ, kQ}));
  ASSERT_EQ(s.count.sizes(), at::IntArrayRef({kB, kP}));
  EXPECT_EQ(s.lifted.scalar_type(), at::kFloat);
  EXPECT_EQ(s.count.scalar_type(), at::kFloat);

  // Sample 0, by hand. f0/f1: camera 0/1's feature maps [C, Hf, Wf]; mean(c, z, q) and seen(z, q)
  // read lifted[0, c*Z + z, q] and lifted[0, C*Z + z, q].
  const at::Tensor f0 = in.features[0].to(at::kDouble), f1 = in.features[1].to(at::kDouble);
  auto f = [](const at::Tensor& m, int64_t c, int64_t y, int64_t x) {
    return m[c][y][x].item<double>();
  };
  auto mean = [&](int64_t c, int64_t z, int64_t q) {
    return s.lifted[0][c * kZ + z][q].item<double>();
  };
  auto seen = [&](int64_t z, int64_t q) { return s.lifted[0][kC * kZ + z][q].item<double>(); };
  // fp32 against the exact taps (lifted_bound): 4 coord max|f| + gamma(N + 8) max|f|.
  const double kTol = lifted_bound(in.features, kN, tol::kFp32Unit);
  for (int64_t c = 0; c < kC; ++c) {
    SCOPED_TRACE("channel " + std::to_string(c));
    // p0: camera 0 alone, weights (1 - 0.25, 0.25) in x and y.
    EXPECT_NEAR(mean(c, 0, 0),
                0.5625 * f(f0, c, 1, 2) + 0.1875 * f(f0, c, 1, 3) + 0.1875 * f(f0, c, 2, 2) +
                    0.0625 * f(f0, c, 2, 3),
                kTol);
    // p1: the mean of camera 0 (x on a column, y = 0.75) and camera 1 (x = 0.75, y on a row).
    const double p1_cam0 = 0.25 * f(f0, c, 0, 3) + 0.75 * f(f0, c, 1, 3);
    const double p1_cam1 = 0.25 * f(f1, c, 2, 0) + 0.75 * f(f1, c, 2, 1);
    EXPECT_NEAR(mean(c, 0, 1), 0.5 * (p1_cam0 + p1_cam1), kTol);
    // p2: seen by none (camera 0's projection lies in the map, camera 1's is NaN).
    EXPECT_EQ(mean(c, 0, 2), 0.0);
    // p3: camera 1 at x = -0.25, y = 3.25: only tap (3, 0) is in the map, weight 0.75 * 0.75.
    EXPECT_NEAR(mean(c, 1, 0), 0.5625 * f(f1, c, 3, 0), kTol);
    // p4: camera 0 at x = 5.25, y = -0.25: only tap (0, 5), weight 0.75 * 0.75.
    EXPECT_NEAR(mean(c, 1, 1), 0.5625 * f(f0, c, 0, 5), kTol);
    // p5: both cameras exactly on feature pixel centres.
    EXPECT_NEAR(mean(c, 1, 2), 0.5 * (f(f0, c, 2, 1) + f(f1, c, 0, 4)), kTol);
  }
  const double expect_seen[kZ][kQ] = {{1, 1, 0}, {1, 1, 1}};
  const float expect_count[kP] = {1, 2, 0, 1, 1, 2};
  for (int64_t z = 0; z < kZ; ++z) {
    for (int64_t q = 0; q < kQ; ++q)
      EXPECT_EQ(seen(z, q), expect_seen[z][q]) << "z " << z << " q " << q;
  }
  for (int64_t b = 0; b < kB; ++b) {
    for (int64_t p = 0; p < kP; ++p)
      EXPECT_EQ(s.count[b][p].item<float>(), expect_count[p]) << "b " << b << " p " << p;
  }
  EXPECT_TRUE(at::isfinite(s.lifted).all().item<bool>());

  // Both samples (sample 1 reads the other feature maps through swapped cameras) against the loops.
  const HandResult ref = hand_reference(in.features, in.uv, in.visible, kZ, kImgH, kImgW);
  EXPECT_TRUE(tol::within(s.lifted, ref.lifted, kTol));
  EXPECT_TRUE(at::equal(s.count.to(at::kDouble), ref.count));
  EXPECT_GT((s.lifted[0] - s.lifted[1]).abs().max().item<double>(), 2 * kTol)
      << "the samples must read their own feature maps";
}

TEST(BevSampleTest, RandomInputsMatchHandLoopsAndFloat64AutogradGradient) {
  at::manual_seed(12);
  // Different strides in x (12 px) and y (8 px) so swapped axes show; some projections outside the
  // image (only padding taps); unseen points with inf/NaN projections; a camera that sees nothing.
  const int64_t b = 2, n = 3, c = 4, fh = 5, fw = 7, z = 3, q = 23, p = z * q, img_h = 40,
                img_w = 84;
  const at::Tensor features = at::randn({b * n, c, fh, fw});
  at::Tensor uv = at::stack(
      {(at::rand({b, n, p}) * 1.2 - 0.1) * img_w, (at::rand({b, n, p}) * 1.2 - 0.1) * img_h}, -1);
  at::Tensor visible = at::rand({b, n, p}) < 0.4;
  visible[1][2].fill_(false);
  const at::Tensor hidden = (~visible).nonzero();
  ASSERT_GE(hidden.size(0), 3);
  auto unseen_uv = [&](int64_t i) {
    return uv[hidden[i][0].item<int64_t>()][hidden[i][1].item<int64_t>()]
             [hidden[i][2].item<int64_t>()];
  };
  unseen_uv(0)[0] = kInf;  // behind-camera projections
  unseen_uv(1)[1] = -kInf;
  unseen_uv(2).fill_(kNaN);
  const at::Tensor count = visible.sum(1);
  ASSERT_TRUE((count == 0).any().item<bool>() && (count == 1).any().item<bool>() &&
              (count >= 2).any().item<bool>());

  at::Tensor f32 = features.clone().requires_grad_(true);
  at::Tensor uv_leaf = uv.clone().requires_grad_(true);
  const BevSample s = bev_sample(f32, uv_leaf, visible, z, img_h, img_w, /*fused=*/false);
  EXPECT_FALSE(s.count.requires_grad());
  const HandResult hand = hand_reference(features, uv, visible, z, img_h, img_w);
  EXPECT_TRUE(tol::within(s.lifted, hand.lifted, lifted_bound(features, n, tol::kFp32Unit)));
  EXPECT_TRUE(at::equal(s.count.to(at::kDouble), hand.count));

  at::Tensor f64 = features.to(at::kDouble).requires_grad_(true);
  const at::Tensor ref = autograd_reference(f64, uv, visible, z, img_h, img_w);
  // Both in float64: each within lifted_bound at u = 2^-53 of the exact taps.
  ASSERT_TRUE(tol::within(ref, hand.lifted, 2 * lifted_bound(features, n, tol::kFp64Unit)))
      << "the two references disagree";

  const at::Tensor w = at::randn({b, c * z + z, q}, at::kDouble);
  (s.lifted * w.to(at::kFloat)).sum().backward();
  (ref * w).sum().backward();
  ASSERT_TRUE(f32.grad().defined());
  EXPECT_FALSE(uv_leaf.grad().defined()) << "gradients flow to the features only";
  // fp32 against float64 (whose own error, gradient_bound at u = 2^-53, is counted too).
  const double scale = f64.grad().abs().max().item<double>();
  const at::Tensor bound =
      gradient_bound(features, uv, visible, w, z, img_h, img_w, tol::kFp32Unit) +
      gradient_bound(features, uv, visible, w, z, img_h, img_w, tol::kFp64Unit);
  EXPECT_TRUE(tol::within(f32.grad(), f64.grad(), bound));
  EXPECT_GT(scale, 0.1);
  EXPECT_EQ(f32.grad()[1 * n + 2].abs().max().item<float>(), 0.0f)
      << "a camera that sees nothing gets no gradient";
  EXPECT_TRUE(at::isfinite(f32.grad()).all().item<bool>());
}

TEST(BevSampleTest, SixteenBitFeaturesAreSampledInFloat32AndRoundedOnce) {
  at::manual_seed(13);
  const Inputs in = hand_inputs();
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    const at::Tensor half = in.features.to(dtype);
    const BevSample s = bev_sample(half, in.uv, in.visible, kZ, kImgH, kImgW, /*fused=*/false);
    EXPECT_EQ(s.lifted.scalar_type(), dtype);
    EXPECT_EQ(s.count.scalar_type(), at::kFloat);
    const BevSample wide =
        bev_sample(half.to(at::kFloat), in.uv, in.visible, kZ, kImgH, kImgW, /*fused=*/false);
    EXPECT_TRUE(at::equal(s.lifted, wide.lifted.to(dtype))) << dtype;
  }
}

TEST(BevSampleTest, CpuTensorsAreNotFusedAndFallBackToAten) {
  at::manual_seed(14);
  const Inputs in = hand_inputs();
  EXPECT_FALSE(fused_bev_sample_supported(in.features, in.uv, in.visible));
  EXPECT_FALSE(fused_bev_sample_supported(in.features.to(at::kBFloat16), in.uv, in.visible));
  const BevSample fused =
      bev_sample(in.features, in.uv, in.visible, kZ, kImgH, kImgW, /*fused=*/true);
  const BevSample aten =
      bev_sample(in.features, in.uv, in.visible, kZ, kImgH, kImgW, /*fused=*/false);
  EXPECT_TRUE(at::equal(fused.lifted, aten.lifted));
  EXPECT_TRUE(at::equal(fused.count, aten.count));
}

// Runs `f`, which must throw parallax::Error whose message contains `needle`.
template <class F>
void expect_error(F&& f, const std::string& needle) {
  EXPECT_THROW(f(), Error) << needle;
  try {
    f();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  } catch (...) {
  }
}

TEST(BevSampleTest, InconsistentShapesThrowErrorsNamingTheProblem) {
  const Inputs in = hand_inputs();
  const at::Tensor& f = in.features;
  const at::Tensor& uv = in.uv;
  const at::Tensor& vis = in.visible;
  // features.size(0) != B * N.
  expect_error([&] { bev_sample(f.narrow(0, 0, 3), uv, vis, kZ, kImgH, kImgW, false); }, "B*N = 4");
  expect_error([&] { bev_sample(f[0], uv, vis, kZ, kImgH, kImgW, false); },
               "features must be [B*N, C, Hf, Wf]");
  // P = 6 is not a multiple of 4 heights; no heights at all.
  expect_error([&] { bev_sample(f, uv, vis, 4, kImgH, kImgW, false); }, "not 4 heights");
  expect_error([&] { bev_sample(f, uv, vis, 0, kImgH, kImgW, false); }, "heights");
  // visible not bool, or not shaped like uv.
  expect_error([&] { bev_sample(f, uv, vis.to(at::kFloat), kZ, kImgH, kImgW, false); },
               "visible must be bool");
  expect_error([&] { bev_sample(f, uv, vis.narrow(2, 0, 5), kZ, kImgH, kImgW, false); },
               "visible must be [B, N, P]");
  // uv's last dimension is not (u, v); uv not 4-d.
  expect_error(
      [&] {
        bev_sample(f, at::cat({uv, uv.narrow(3, 0, 1)}, 3), vis, kZ, kImgH, kImgW, false);
      },
      "uv must be [B, N, P, 2]");
  expect_error([&] { bev_sample(f, uv[0], vis, kZ, kImgH, kImgW, false); },
               "uv must be [B, N, P, 2]");
  // A degenerate image.
  expect_error([&] { bev_sample(f, uv, vis, kZ, 0, kImgW, false); }, "image size");
  // The same checks guard the fused entry point.
  expect_error([&] { bev_sample(f.narrow(0, 0, 3), uv, vis, kZ, kImgH, kImgW, true); }, "B*N = 4");
}

}  // namespace
}  // namespace parallax::kernels
