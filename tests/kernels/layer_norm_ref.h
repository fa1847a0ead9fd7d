// A float64 reference of kernels::add_layer_norm for the kernel tests: the sum rounded to x's
// dtype (as `x + residual` in that dtype), LayerNorm with the weights in their own precision,
// gradients by autograd in float64.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace parallax::kernels::testing {

struct LnResult {
  at::Tensor y, sum, dx, dres, dweight, dbias;  // float64
};

// dy: upstream gradient of y; dsum: of the sum (undefined: none).
inline LnResult layer_norm_reference(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                     const at::Tensor& bias, double eps, const at::Tensor& dy,
                                     const at::Tensor& dsum) {
  at::Tensor x64 = x.to(at::kDouble).detach().requires_grad_(true);
  at::Tensor r64 = residual.defined() ? residual.to(at::kDouble).detach().requires_grad_(true) : at::Tensor();
  at::Tensor w64 = weight.to(at::kDouble).detach().requires_grad_(true);
  at::Tensor b64 = bias.to(at::kDouble).detach().requires_grad_(true);
  at::Tensor s = x64;
  if (r64.defined()) {
    // Round the sum to x's dtype in the forward only (straight-through for the gradient).
    const at::Tensor exact = x64 + r64;
    s = exact + (exact.to(x.scalar_type()).to(at::kDouble) - exact).detach();
  }
  at::Tensor y = at::layer_norm(s, {x.size(-1)}, w64, b64, eps);
  at::Tensor loss = (y * dy.to(at::kDouble)).sum();
  if (dsum.defined()) loss = loss + (s * dsum.to(at::kDouble)).sum();
  loss.backward();
  return {y.detach(), r64.defined() ? s.detach() : at::Tensor(), x64.grad(),
          r64.defined() ? r64.grad() : at::Tensor(), w64.grad(), b64.grad()};
}

// ||a - b|| / ||b|| (0 when both are zero).
inline double rel_err(const at::Tensor& a, const at::Tensor& b) {
  const double den = b.to(at::kDouble).norm().item<double>();
  const double num = (a.to(at::kDouble) - b.to(at::kDouble)).norm().item<double>();
  return den == 0 ? num : num / den;
}

}  // namespace parallax::kernels::testing
