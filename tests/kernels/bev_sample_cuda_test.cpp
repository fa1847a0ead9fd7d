// The fused BEV sampling CUDA kernels (bev_sample with fused=true) against the ATen path
// (fused=false, itself checked against hand-written loops and a float64 autograd reference in
// bev_sample_test.cpp) on the same CUDA inputs: every supported dtype; 1 and 6 cameras; channel
// counts that are and are not multiples of the kernels' channel chunks and tiles; a small feature
// map and one large enough for the backward's global-atomics path; 1 and 4 heights. Inputs put
// visible points off the map (zero-padding taps), unseen points at inf/NaN pixels (behind-camera
// projections), and a camera that sees nothing. Also the inputs the kernels refuse, which must
// fall back to the ATen result. Skips without a GPU.
#include "kernels/bev_sample.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

namespace parallax::kernels {
namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

struct Shape {
  int64_t n, c, fh, fw, z;
};
constexpr int64_t kB = 2, kQ = 1237, kStride = 8;  // Q: not a multiple of any block size

struct Inputs {
  at::Tensor features, uv, visible;
  int64_t z, image_h, image_w;
};

// Random features; uv uniform in [-0.1 W, 1.1 W] x [-0.1 H, 1.1 H]; each camera sees each point
// with probability 0.35, except the last camera of sample 1, which sees nothing; ~2% of the unseen
// points project to +-inf or NaN.
Inputs make_inputs(const Shape& s, at::ScalarType dtype) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const int64_t p = s.z * kQ, h = s.fh * kStride, w = s.fw * kStride;
  const at::Tensor features = at::randn({kB * s.n, s.c, s.fh, s.fw}, cuda).to(dtype);
  at::Tensor uv = at::stack({(at::rand({kB, s.n, p}, cuda) * 1.2 - 0.1) * static_cast<double>(w),
                             (at::rand({kB, s.n, p}, cuda) * 1.2 - 0.1) * static_cast<double>(h)},
                            -1);
  at::Tensor visible = at::rand({kB, s.n, p}, cuda) < 0.35;
  visible[1][s.n - 1].fill_(false);
  const double inf = std::numeric_limits<double>::infinity(),
               nan = std::numeric_limits<double>::quiet_NaN();
  uv.select(-1, 0).masked_fill_((~visible) & (at::rand({kB, s.n, p}, cuda) < 0.02), inf);
  uv.select(-1, 1).masked_fill_((~visible) & (at::rand({kB, s.n, p}, cuda) < 0.02), -inf);
  uv.masked_fill_(((~visible) & (at::rand({kB, s.n, p}, cuda) < 0.02)).unsqueeze(-1), nan);
  return {features, uv.contiguous(), visible, s.z, h, w};
}

struct Outcome {
  at::Tensor lifted, count, grad;
};

// Forward, then the gradient of sum(lifted * w) w.r.t. the features.
Outcome run_both_passes(const Inputs& in, const at::Tensor& w, bool fused) {
  at::Tensor f = in.features.clone().requires_grad_(true);
  const BevSample s = bev_sample(f, in.uv, in.visible, in.z, in.image_h, in.image_w, fused);
  {
    // The kernels' gradient (and workspace) come from at::empty: hand the caching allocator blocks
    // of exactly that size full of NaN first, so elements the backward does not write show up.
    const at::Tensor junk1 =
        at::full(f.sizes(), std::numeric_limits<double>::quiet_NaN(), f.options());
    const at::Tensor junk2 =
        at::full(f.sizes(), std::numeric_limits<double>::quiet_NaN(), f.options());
  }
  torch::autograd::backward({s.lifted}, {w});
  return {s.lifted.detach(), s.count, f.grad()};
}

// |a - b| <= rtol * |b| + atol elementwise, with the worst element in the failure message.
::testing::AssertionResult close(const at::Tensor& a, const at::Tensor& b, double rtol,
                                 const at::Tensor& atol) {
  if (a.sizes() != b.sizes())
    return ::testing::AssertionFailure() << "sizes " << a.sizes() << " vs " << b.sizes();
  const at::Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  const at::Tensor excess =
      at::where(at::isnan(a64) | at::isnan(b64), at::full({}, 1.0, a64.options()),
                (a64 - b64).abs() - (b64.abs() * rtol + atol.to(at::kDouble)));
  const int64_t worst = excess.flatten().argmax().item<int64_t>();
  if (excess.flatten()[worst].item<double>() <= 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "element " << worst << " of " << a.sizes() << ": "
         << a64.flatten()[worst].item<double>() << " vs " << b64.flatten()[worst].item<double>()
         << " (rtol " << rtol << ", atol "
         << atol.to(at::kDouble).expand_as(a64).flatten()[worst].item<double>() << ")";
}

::testing::AssertionResult close(const at::Tensor& a, const at::Tensor& b, double rtol,
                                 double atol) {
  return close(a, b, rtol, at::full({}, atol, at::kDouble).to(a.device()));
}

// One unit in the last place, relative: 2^-7 for bf16 (8 significant bits), 2^-10 for fp16.
double ulp(at::ScalarType t) {
  return t == at::kBFloat16 ? std::ldexp(1.0, -7) : std::ldexp(1.0, -10);
}

// Both paths compute a tap position as grid_sample does, ix = ((g + 1) * Wf - 1) / 2 with
// g = u * (2 / W) - 1, in fp32, but may round differently (ATen's grid_sample is compiled with
// FMA contraction; measured on an H100 with a 160 x 160 map: forward differences up to 3e-5 on
// O(1) values). Fused or not, g differs by at most 3.4 u (|u * 2 / W| <= 2.2, |g| <= 1.2), so
// ix by 1.7 u Wf, and (g + 1) * Wf - 1 (one rounding or two, of values <= 2.2 Wf) by 2.2 u Wf
// more: positions differ by at most `coord` = 4 u max(Hf, Wf) feature pixels per axis, which
// moves a sample by up to 2 coord max|f| per axis and a tap weight by up to 2 coord.
double coord_difference(int64_t fh, int64_t fw) {
  return static_cast<double>(std::max(fh, fw)) * std::ldexp(1.0, -22);
}

// Forward, fp32 values before the final rounding: each path is within gamma(N + 8) max|f| of the
// exact mean at its positions (6 roundings per camera's 4 taps, the sum over N cameras, the
// division; bev_sample_test.cpp), and the positions move a sample by 4 coord max|f|.
double forward_difference(const at::Tensor& features, int64_t n) {
  const double fmax = features.abs().max().item<double>(), u = std::ldexp(1.0, -24);
  const double k = static_cast<double>(n) + 8;
  return fmax *
         (2 * k * u / (1 - k * u) + 4 * coord_difference(features.size(2), features.size(3)));
}

// Per feature pixel [B*N, 1, Hf, Wf]: how many visible (sample, camera, point)s may add to its
// gradient, counting every pixel of the taps at positions within coord_difference() of the
// exact one (up to 3 columns and 3 rows).
at::Tensor contributions(const Inputs& in) {
  const int64_t b = in.uv.size(0), n = in.uv.size(1), fh = in.features.size(2),
                fw = in.features.size(3);
  const double coord = coord_difference(fh, fw);
  const at::Tensor uv = in.uv.to(at::kDouble);
  const at::Tensor ix =
      uv.select(-1, 0) * (static_cast<double>(fw) / static_cast<double>(in.image_w)) - 0.5;
  const at::Tensor iy =
      uv.select(-1, 1) * (static_cast<double>(fh) / static_cast<double>(in.image_h)) - 0.5;
  const at::Tensor x_lo = (ix - coord).floor(), x_hi = (ix + coord).floor() + 1;
  const at::Tensor y_lo = (iy - coord).floor(), y_hi = (iy + coord).floor() + 1;
  const at::Tensor cam = at::arange(b * n, uv.options().dtype(at::kLong)).view({b, n, 1});
  at::Tensor m = at::zeros({b * n * fh * fw}, uv.options());
  for (int dy = 0; dy < 3; ++dy) {
    for (int dx = 0; dx < 3; ++dx) {
      const at::Tensor x = x_lo + dx, y = y_lo + dy;
      const at::Tensor ok =
          in.visible & (x <= x_hi) & (y <= y_hi) & (x >= 0) & (x < fw) & (y >= 0) & (y < fh);
      const at::Tensor flat =
          (cam * fh + y.clamp(0, fh - 1).to(at::kLong)) * fw + x.clamp(0, fw - 1).to(at::kLong);
      m.index_add_(0, flat.masked_select(ok), at::ones({ok.sum().item<int64_t>()}, uv.options()));
    }
  }
  return m.view({b * n, 1, fh, fw});
}

class BevSampleCudaTest : public ::testing::TestWithParam<std::tuple<at::ScalarType, Shape>> {};

TEST_P(BevSampleCudaTest, FusedMatchesAtenForwardAndBackward) {
  SKIP_WITHOUT_CUDA();
  const auto [dtype, shape] = GetParam();
  at::manual_seed(shape.n * 1000 + shape.c * 10 + shape.z + shape.fh);
  const Inputs in = make_inputs(shape, dtype);
  ASSERT_TRUE(fused_bev_sample_supported(in.features, in.uv, in.visible));

  // The cases the kernels must handle all occur.
  const at::Tensor seen_by = in.visible.sum(1);  // [B, P]
  EXPECT_TRUE((seen_by == 0).any().item<bool>());
  EXPECT_TRUE((seen_by == 1).any().item<bool>());
  if (shape.n > 1) {
    EXPECT_TRUE((seen_by >= 2).any().item<bool>());
  }
  const at::Tensor u = in.uv.select(-1, 0), v = in.uv.select(-1, 1);
  const at::Tensor off_image = (u < 0) | (u >= static_cast<double>(in.image_w)) | (v < 0) |
                               (v >= static_cast<double>(in.image_h));
  EXPECT_TRUE((in.visible & off_image).any().item<bool>())
      << "visible points whose taps are all padding";
  EXPECT_TRUE(((~in.visible) & ~at::isfinite(in.uv).all(-1)).any().item<bool>())
      << "inf/NaN at unseen points";

  const int64_t cz = shape.c * shape.z;
  const at::Tensor w = at::randn({kB, cz + shape.z, kQ}, in.features.options());
  const Outcome kernel = run_both_passes(in, w, /*fused=*/true);
  const Outcome ref = run_both_passes(in, w, /*fused=*/false);

  ASSERT_EQ(kernel.lifted.sizes(), ref.lifted.sizes());
  EXPECT_EQ(kernel.lifted.scalar_type(), dtype);
  EXPECT_EQ(kernel.count.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::isfinite(kernel.lifted).all().item<bool>());
  EXPECT_TRUE(at::isfinite(kernel.grad).all().item<bool>());
  EXPECT_TRUE(at::equal(kernel.count, ref.count));
  EXPECT_TRUE(at::equal(kernel.lifted.narrow(1, cz, shape.z), ref.lifted.narrow(1, cz, shape.z)))
      << "seen flags";

  const double coord = coord_difference(shape.fh, shape.fw);

  // Forward: fp32 differences of forward_difference(); in 16 bits each path rounds its fp32 value
  // once, so they may differ by that plus one unit in the last place where the values straddle a
  // rounding boundary.
  const bool fp32 = dtype == at::kFloat;
  const double rtol = fp32 ? 0.0 : ulp(dtype);
  EXPECT_TRUE(close(kernel.lifted.narrow(1, 0, cz), ref.lifted.narrow(1, 0, cz), rtol,
                    forward_difference(in.features, shape.n)));

  // Backward: each path accumulates a pixel's M contributions w_tap W / count in fp32 (atomics, in
  // any order) and rounds once: within gamma(M + 2) of their sum of magnitudes A (the ATen
  // gradient for the upstream |W|; A computed in fp32 is within gamma(M + 2) of itself, so the
  // bound takes 1.01 A), and the positions move each contribution's weight by up to 2 coord: at
  // most 2 coord M max|W| per pixel. M counts the visible (sample, camera, point)s whose taps at
  // positions within coord of theirs cover the pixel. 16 bits: one ulp more, as the forward.
  const Outcome mag = run_both_passes(in, w.abs(), /*fused=*/false);
  const at::Tensor a = mag.grad.to(at::kDouble).abs() * 1.01;
  const at::Tensor m = contributions(in);
  const double wmax = w.abs().max().item<double>(), unit = std::ldexp(1.0, -24);
  const at::Tensor bound = 2 * ((m + 2) * unit / (1 - (m + 2) * unit) * a + 2 * coord * m * wmax);
  ASSERT_GT(ref.grad.abs().max().item<double>(), 0.0);
  EXPECT_TRUE(close(kernel.grad, ref.grad, fp32 ? 0.0 : 2 * ulp(dtype), bound));
  const at::Tensor blind = kernel.grad[1 * shape.n + shape.n - 1];  // the camera that sees nothing
  EXPECT_EQ(blind.abs().max().item<double>(), 0.0);
  EXPECT_EQ(ref.grad[1 * shape.n + shape.n - 1].abs().max().item<double>(), 0.0);
}

std::string param_name(const ::testing::TestParamInfo<std::tuple<at::ScalarType, Shape>>& info) {
  const auto& [dtype, s] = info.param;
  const char* t = dtype == at::kFloat ? "f32" : dtype == at::kBFloat16 ? "bf16" : "f16";
  return std::string(t) + "_N" + std::to_string(s.n) + "_C" + std::to_string(s.c) + "_" +
         std::to_string(s.fh) + "x" + std::to_string(s.fw) + "_Z" + std::to_string(s.z);
}

// C = 37 is a multiple of neither the forward's 8-channel chunks nor the backward's 32-channel
// tiles; a 32-channel tile of a 160 x 160 map (3.3 MB) exceeds any GPU's shared memory, so that
// backward takes the global-atomics path (16 x 44 takes the shared-memory tile).
INSTANTIATE_TEST_SUITE_P(
    DtypesAndShapes, BevSampleCudaTest,
    ::testing::Combine(::testing::Values(at::kFloat, at::kBFloat16, at::kHalf),
                       ::testing::Values(Shape{1, 37, 16, 44, 1}, Shape{1, 64, 160, 160, 4},
                                         Shape{6, 37, 16, 44, 4}, Shape{6, 64, 16, 44, 1},
                                         Shape{6, 37, 160, 160, 1}, Shape{6, 64, 160, 160, 4},
                                         Shape{1, 37, 160, 160, 4}, Shape{6, 64, 16, 44, 4})),
    param_name);

// Inputs outside the kernels' range are refused, and bev_sample (fused=true) returns the ATen
// result.
TEST(BevSampleCudaFallbackTest, UnsupportedInputsFallBackToAten) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(77);
  const Inputs base = make_inputs({6, 16, 8, 12, 2}, at::kFloat);
  ASSERT_TRUE(fused_bev_sample_supported(base.features, base.uv, base.visible));
  auto expect_aten = [](const Inputs& in, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_FALSE(fused_bev_sample_supported(in.features, in.uv, in.visible));
    const BevSample got =
        bev_sample(in.features, in.uv, in.visible, in.z, in.image_h, in.image_w, /*fused=*/true);
    const BevSample ref =
        bev_sample(in.features, in.uv, in.visible, in.z, in.image_h, in.image_w, /*fused=*/false);
    EXPECT_EQ(got.lifted.scalar_type(), in.features.scalar_type());
    EXPECT_TRUE(at::equal(got.lifted, ref.lifted));
    EXPECT_TRUE(at::equal(got.count, ref.count));
  };
  // 33 cameras: more than the kernels' visibility bits.
  expect_aten(make_inputs({kBevSampleMaxCameras + 1, 16, 8, 12, 2}, at::kFloat), "33 cameras");
  // Non-contiguous features (a transposed map).
  Inputs strided = base;
  strided.features = base.features.transpose(2, 3).contiguous().transpose(2, 3);
  ASSERT_FALSE(strided.features.is_contiguous());
  expect_aten(strided, "non-contiguous features");
  // float64 features.
  Inputs wide = base;
  wide.features = base.features.to(at::kDouble);
  expect_aten(wide, "float64 features");
}

// bev_sample with `uv` in place of the float32, aligned base.uv gives the ATen path's result on
// base.uv (to float32 rounding), whichever path takes it.
void expect_sampled_like_float32_uv(const Inputs& base, const at::Tensor& uv) {
  const BevSample got =
      bev_sample(base.features, uv, base.visible, base.z, base.image_h, base.image_w);
  const BevSample ref = bev_sample(base.features, base.uv, base.visible, base.z, base.image_h,
                                   base.image_w, /*fused=*/false);
  // The same inputs through the kernels (uv converted to float32, which the kernels then take) or
  // the ATen path: the main test's forward bound.
  EXPECT_TRUE(close(got.lifted.narrow(1, 0, ref.lifted.size(1) - base.z),
                    ref.lifted.narrow(1, 0, ref.lifted.size(1) - base.z), 0.0,
                    forward_difference(base.features, base.uv.size(1))));
  EXPECT_TRUE(at::equal(got.lifted.narrow(1, ref.lifted.size(1) - base.z, base.z),
                        ref.lifted.narrow(1, ref.lifted.size(1) - base.z, base.z)))
      << "seen flags";
  EXPECT_TRUE(at::equal(got.count, ref.count));
}

// uv in float64: the kernels refuse it as given, and bev_sample samples it as float32 (the
// geometry is data), so the result equals the float32 one.
TEST(BevSampleCudaFallbackTest, Float64UvIsSampledAsFloat32) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(78);
  const Inputs base = make_inputs({6, 16, 8, 12, 2}, at::kFloat);
  const at::Tensor uv64 = base.uv.to(at::kDouble);
  EXPECT_FALSE(fused_bev_sample_supported(base.features, uv64, base.visible));
  expect_sampled_like_float32_uv(base, uv64);
}

// A contiguous uv that starts at an odd float (a view into a larger buffer): the kernels read a
// point's (u, v) as one 8-byte load, so they must either refuse such a tensor or read it right.
// Run it in its own process (ctest does): a misaligned load leaves the CUDA context unusable.
TEST(BevSampleCudaFallbackTest, UvAtAnOddOffsetIsSampledCorrectly) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(79);
  const Inputs base = make_inputs({6, 16, 8, 12, 2}, at::kFloat);
  const at::Tensor buffer = at::empty({base.uv.numel() + 1}, base.uv.options());
  const at::Tensor odd = buffer.narrow(0, 1, base.uv.numel()).view(base.uv.sizes()).copy_(base.uv);
  ASSERT_TRUE(odd.is_contiguous());
  expect_sampled_like_float32_uv(base, odd);
}

}  // namespace
}  // namespace parallax::kernels
