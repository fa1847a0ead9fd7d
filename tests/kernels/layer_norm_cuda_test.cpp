// The fused LayerNorm CUDA kernels against the float64 reference: every supported dtype, with and
// without the fused residual add, widths from one vector (8) to the maximum (1024) including
// widths that leave lanes idle, forward outputs and all four gradients; determinism of the
// weight gradients; fallback to ATen outside the supported range. Skips without a GPU.
#include "kernels/layer_norm.h"
#include "tests/common/tolerance.h"
#include "tests/kernels/layer_norm_ref.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdint>
#include <tuple>

namespace parallax::kernels {
namespace {

namespace tol = parallax::testing;

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

struct LnRun {
  at::Tensor y, sum, dx, dres, dw, db;
};

LnRun run_fused(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w, const at::Tensor& b,
                const at::Tensor& dy, const at::Tensor& ds, bool fused = true) {
  at::Tensor xg = x.clone().requires_grad_(true),
             rg = r.defined() ? r.clone().requires_grad_(true) : r;
  at::Tensor wg = w.clone().requires_grad_(true), bg = b.clone().requires_grad_(true);
  auto [y, sum] = add_layer_norm(xg, rg, wg, bg, 1e-6, fused);
  at::Tensor loss = (y.to(at::kFloat) * dy.to(at::kFloat)).sum();
  if (sum.defined()) loss = loss + (sum.to(at::kFloat) * ds.to(at::kFloat)).sum();
  loss.backward();
  return {y, sum, xg.grad(), rg.defined() ? rg.grad() : at::Tensor(), wg.grad(), bg.grad()};
}

class FusedLayerNormTest
    : public ::testing::TestWithParam<std::tuple<at::ScalarType, int64_t, bool>> {};

TEST_P(FusedLayerNormTest, MatchesFloat64Reference) {
  SKIP_WITHOUT_CUDA();
  const auto [dtype, cols, with_residual] = GetParam();
  at::manual_seed(cols + (with_residual ? 1 : 0));
  const auto opt = at::TensorOptions().device(at::kCUDA);
  const int64_t rows = 1237;  // not a multiple of the rows per block
  const at::Tensor x = (at::randn({rows, cols}, opt) * 2 + 0.5).to(dtype);
  const at::Tensor r = with_residual ? at::randn({rows, cols}, opt).to(dtype) : at::Tensor();
  const at::Tensor w = at::randn({cols}, opt) * 0.5 + 1,
                   b = at::randn({cols}, opt) * 0.1;  // fp32 masters
  const at::Tensor dy = at::randn({rows, cols}, opt).to(dtype);
  const at::Tensor ds = with_residual ? at::randn({rows, cols}, opt).to(dtype) : at::Tensor();
  ASSERT_TRUE(fused_layer_norm_supported(x, r, w, b));
  const LnRun got = run_fused(x, r, w, b, dy, ds);
  const auto ref = testing::layer_norm_reference(x, r, w, b, 1e-6, dy, ds);
  // Bounds from the arithmetic (testing::layer_norm_bound): statistics and accumulations in fp32,
  // y and dx rounded once to the dtype (its unit roundoff), the weight gradients fp32.
  const double out_unit = dtype == at::kFloat ? 0.0 : tol::unit_roundoff(dtype);
  const at::Tensor s = with_residual ? (x + r) : x;
  const auto bound = testing::layer_norm_bound(ref, s, w, b, 1e-6, dy, ds, out_unit);
  EXPECT_EQ(got.y.scalar_type(), dtype);
  EXPECT_TRUE(tol::within(got.y, ref.y, bound.y));
  EXPECT_TRUE(tol::within(got.dx, ref.dx, bound.dx));
  EXPECT_EQ(got.dw.scalar_type(), at::kFloat);
  EXPECT_TRUE(tol::within(got.dw, ref.dweight, bound.dweight));
  EXPECT_TRUE(tol::within(got.db, ref.dbias, bound.dbias));
  if (with_residual) {
    // The sum is exactly what `x + r` gives in the dtype.
    EXPECT_TRUE(at::equal(got.sum, x + r));
    EXPECT_TRUE(tol::within(got.dres, ref.dres, bound.dx));
    EXPECT_TRUE(at::equal(got.dres, got.dx));
  }
  // The ATen path (fused=false) meets the same bounds, plus its cast of the fp32 weight and bias
  // to a 16-bit dtype: the kernels are not looser than it.
  const LnRun aten = run_fused(x, r, w, b, dy, ds, /*fused=*/false);
  const auto aten_bound = testing::layer_norm_bound(ref, s, w, b, 1e-6, dy, ds, out_unit, out_unit);
  EXPECT_TRUE(tol::within(aten.y, ref.y, aten_bound.y));
}

INSTANTIATE_TEST_SUITE_P(DtypesWidthsResidual, FusedLayerNormTest,
                         ::testing::Combine(::testing::Values(at::kFloat, at::kBFloat16, at::kHalf),
                                            ::testing::Values(int64_t{8}, int64_t{264},
                                                              int64_t{768}, int64_t{1024}),
                                            ::testing::Bool()));

TEST(FusedLayerNormCudaTest, WeightGradientsAreDeterministic) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(3);
  const auto opt = at::TensorOptions().device(at::kCUDA);
  const at::Tensor x = at::randn({25216, 768}, opt).to(at::kBFloat16),
                   r = at::randn({25216, 768}, opt).to(at::kBFloat16);
  const at::Tensor w = at::randn({768}, opt), b = at::randn({768}, opt);
  const at::Tensor dy = at::randn({25216, 768}, opt).to(at::kBFloat16), ds = at::randn_like(dy);
  const LnRun a = run_fused(x, r, w, b, dy, ds), c = run_fused(x, r, w, b, dy, ds);
  EXPECT_TRUE(at::equal(a.dw, c.dw));
  EXPECT_TRUE(at::equal(a.db, c.db));
  EXPECT_TRUE(at::equal(a.dx, c.dx));
}

TEST(FusedLayerNormCudaTest, UnsupportedInputsFallBackToAten) {
  SKIP_WITHOUT_CUDA();
  const auto opt = at::TensorOptions().device(at::kCUDA);
  const at::Tensor w = at::ones({1280}, opt), b = at::zeros({1280}, opt);
  const at::Tensor wide = at::randn({4, 1280}, opt);  // wider than one warp's row
  EXPECT_FALSE(fused_layer_norm_supported(wide, {}, w, b));
  const at::Tensor odd = at::randn({4, 12}, opt);  // not a multiple of 8
  EXPECT_FALSE(fused_layer_norm_supported(odd, {}, at::ones({12}, opt), at::zeros({12}, opt)));
  const at::Tensor strided = at::randn({8, 16}, opt).t();  // not contiguous
  EXPECT_FALSE(fused_layer_norm_supported(strided, {}, at::ones({8}, opt), at::zeros({8}, opt)));
  const at::Tensor y = add_layer_norm(wide, {}, w, b, 1e-6).first;
  // The fallback is this very call (fp32 weights, no cast): the same kernel on the same inputs.
  EXPECT_TRUE(at::equal(y, at::layer_norm(wide, {1280}, w, b, 1e-6)));
}

TEST(FusedLayerNormCudaTest, GammaAndBetaAtAnOddOffsetOfAFlatBuffer) {
  // Under ZeRO a LayerNorm's weight and bias are views into a flat buffer at any element offset
  // (a learned LSQ amax of one element before them). The kernels read them 8 floats at a time, so
  // such views are read from aligned copies: the outputs and all gradients are those of aligned
  // parameters bit for bit (before, 2 x H200 under ZeRO-3: "CUDA error: misaligned address").
  SKIP_WITHOUT_CUDA();
  at::manual_seed(5);
  const auto opt = at::TensorOptions().device(at::kCUDA);
  const int64_t cols = 768;
  const at::Tensor x = at::randn({64, cols}, opt).to(at::kBFloat16),
                   r = at::randn({64, cols}, opt).to(at::kBFloat16);
  const at::Tensor dy = at::randn({64, cols}, opt).to(at::kBFloat16), ds = at::randn_like(dy);
  const at::Tensor leaf = at::randn({1 + 2 * cols}, opt).requires_grad_(true);
  const at::Tensor w = leaf.narrow(0, 1, cols), b = leaf.narrow(0, 1 + cols, cols);
  ASSERT_NE(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16, 0u);
  ASSERT_TRUE(fused_layer_norm_supported(x, r, w, b));
  at::Tensor xg = x.clone().requires_grad_(true), rg = r.clone().requires_grad_(true);
  auto [y, sum] = add_layer_norm(xg, rg, w, b, 1e-6, true);
  ((y.to(at::kFloat) * dy.to(at::kFloat)).sum() + (sum.to(at::kFloat) * ds.to(at::kFloat)).sum())
      .backward();
  torch::cuda::synchronize();  // a misaligned read is reported asynchronously
  const LnRun want = run_fused(x, r, w.detach().clone(), b.detach().clone(), dy, ds);
  EXPECT_TRUE(at::equal(y, want.y));
  EXPECT_TRUE(at::equal(sum, want.sum));
  EXPECT_TRUE(at::equal(xg.grad(), want.dx));
  EXPECT_TRUE(at::equal(rg.grad(), want.dres));
  EXPECT_TRUE(at::equal(leaf.grad().narrow(0, 1, cols), want.dw));
  EXPECT_TRUE(at::equal(leaf.grad().narrow(0, 1 + cols, cols), want.db));
}

}  // namespace
}  // namespace parallax::kernels
