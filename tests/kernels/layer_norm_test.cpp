// kernels::add_layer_norm on the CPU: the ATen path every build has (the fused CUDA kernels are in
// layer_norm_cuda_test.cpp), checked against the float64 reference.
#include "kernels/layer_norm.h"
#include "tests/kernels/layer_norm_ref.h"

#include <gtest/gtest.h>

namespace parallax::kernels {
namespace {

TEST(AddLayerNormTest, CpuComputesTheReferenceAndIsNotFused) {
  at::manual_seed(1);
  const at::Tensor x = at::randn({5, 7, 48}), r = at::randn({5, 7, 48});
  const at::Tensor w = at::randn({48}), b = at::randn({48});
  EXPECT_FALSE(fused_layer_norm_supported(x, r, w, b));
  for (bool with_residual : {false, true}) {
    const at::Tensor res = with_residual ? r : at::Tensor();
    at::Tensor xg = x.clone().requires_grad_(true), rg = res.defined() ? res.clone().requires_grad_(true) : res;
    at::Tensor wg = w.clone().requires_grad_(true), bg = b.clone().requires_grad_(true);
    auto [y, sum] = add_layer_norm(xg, rg, wg, bg, 1e-6);
    EXPECT_EQ(sum.defined(), with_residual);
    const at::Tensor dy = at::randn_like(x), ds = at::randn_like(x);
    at::Tensor loss = (y * dy).sum();
    if (sum.defined()) loss = loss + (sum * ds).sum();
    loss.backward();
    const auto ref = testing::layer_norm_reference(x, res, w, b, 1e-6, dy, with_residual ? ds : at::Tensor());
    EXPECT_LT(testing::rel_err(y, ref.y), 1e-6);
    EXPECT_LT(testing::rel_err(xg.grad(), ref.dx), 1e-5);
    EXPECT_LT(testing::rel_err(wg.grad(), ref.dweight), 1e-5);
    EXPECT_LT(testing::rel_err(bg.grad(), ref.dbias), 1e-5);
    if (with_residual) {
      EXPECT_LT(testing::rel_err(sum, ref.sum), 1e-6);
      EXPECT_LT(testing::rel_err(rg.grad(), ref.dres), 1e-5);
    }
  }
}

}  // namespace
}  // namespace parallax::kernels
