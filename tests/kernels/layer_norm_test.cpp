// kernels::add_layer_norm on the CPU: the ATen path every build has (the fused CUDA kernels are in
// layer_norm_cuda_test.cpp), checked against the float64 reference.
#include "kernels/layer_norm.h"
#include "tests/common/tolerance.h"
#include "tests/kernels/layer_norm_ref.h"

#include <gtest/gtest.h>

namespace parallax::kernels {
namespace {

namespace tol = parallax::testing;

TEST(AddLayerNormTest, CpuComputesTheReferenceAndIsNotFused) {
  at::manual_seed(1);
  const at::Tensor x = at::randn({5, 7, 48}), r = at::randn({5, 7, 48});
  const at::Tensor w = at::randn({48}), b = at::randn({48});
  EXPECT_FALSE(fused_layer_norm_supported(x, r, w, b));
  for (bool with_residual : {false, true}) {
    const at::Tensor res = with_residual ? r : at::Tensor();
    at::Tensor xg = x.clone().requires_grad_(true),
               rg = res.defined() ? res.clone().requires_grad_(true) : res;
    at::Tensor wg = w.clone().requires_grad_(true), bg = b.clone().requires_grad_(true);
    auto [y, sum] = add_layer_norm(xg, rg, wg, bg, 1e-6);
    EXPECT_EQ(sum.defined(), with_residual);
    const at::Tensor dy = at::randn_like(x), ds = at::randn_like(x);
    at::Tensor loss = (y * dy).sum();
    if (sum.defined()) loss = loss + (sum * ds).sum();
    loss.backward();
    const auto ref =
        testing::layer_norm_reference(x, res, w, b, 1e-6, dy, with_residual ? ds : at::Tensor());
    // Bounds from the arithmetic (testing::layer_norm_bound): fp32 outputs, no extra rounding.
    const at::Tensor s = with_residual ? ref.sum : x;
    const auto bound =
        testing::layer_norm_bound(ref, s, w, b, 1e-6, dy, with_residual ? ds : at::Tensor(), 0);
    EXPECT_TRUE(tol::within(y, ref.y, bound.y));
    EXPECT_TRUE(tol::within(xg.grad(), ref.dx, bound.dx));
    EXPECT_TRUE(tol::within(wg.grad(), ref.dweight, bound.dweight));
    EXPECT_TRUE(tol::within(bg.grad(), ref.dbias, bound.dbias));
    if (with_residual) {
      EXPECT_TRUE(
          at::equal(sum, x + r));  // the sum is `x + residual` rounded once, as the reference's
      EXPECT_TRUE(tol::within(rg.grad(), ref.dres, bound.dx));
    }
  }
}

}  // namespace
}  // namespace parallax::kernels
