// A float64 reference of kernels::add_layer_norm for the kernel tests: the sum rounded to x's
// dtype (as `x + residual` in that dtype), LayerNorm with the weights in their own precision,
// gradients by autograd in float64; and the bounds on how far an fp32 evaluation may be from it.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace parallax::kernels::testing {

struct LnResult {
  at::Tensor y, sum, dx, dres, dweight, dbias;  // float64
};

// dy: upstream gradient of y; dsum: of the sum (undefined: none).
inline LnResult layer_norm_reference(const at::Tensor& x, const at::Tensor& residual,
                                     const at::Tensor& weight, const at::Tensor& bias, double eps,
                                     const at::Tensor& dy, const at::Tensor& dsum) {
  at::Tensor x64 = x.to(at::kDouble).detach().requires_grad_(true);
  at::Tensor r64 =
      residual.defined() ? residual.to(at::kDouble).detach().requires_grad_(true) : at::Tensor();
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
  return {y.detach(), r64.defined() ? s.detach() : at::Tensor(),
          x64.grad(), r64.defined() ? r64.grad() : at::Tensor(),
          w64.grad(), b64.grad()};
}

// Elementwise bounds on |computed - exact| for add_layer_norm's outputs and gradients, computed in
// fp32 (statistics and accumulations; the tests/common/tolerance.h model). Per row of N elements
// s (the sum as rounded, the input both sides see), with r = 1 / sqrt(var + eps) and magnitudes
// that include the mean (so they also cover formulas that expand x_hat = (s - mean) r, like
// ATen's backward, whose terms cancel when |mean| >> std):
//   y:  |w| r (|s| + mean|s|) + |b|;
//   dx: r |g| + r mean|g| + r^3 (|s| + mean|s|) mean(|g| (|s| + mean|s|)), g = w dy;
// each within gamma(3 N + 16) of its magnitude: the mean and the variance are sums of N terms
// (Welford or two-pass: at most 2 N roundings each), the rest a handful of roundings per element.
// dw = sum over rows of dy x_hat, db = sum of dy: gamma(R + 3 N + 16) of sum |dy| r (|s| + mean|s|)
// and gamma(R) of sum |dy| (R rows). `out_unit` adds the final rounding of y and dx to their
// dtype (0 for fp32, whose roundings the gamma terms count), `weight_unit` the rounding of the
// weight and bias to a 16-bit dtype (ATen's composition casts them), and dsum's add to dx when
// defined. The factor 1 + 1e-3 covers second-order terms (products of two rounding errors).
struct LnBound {
  at::Tensor y, dx, dweight, dbias;  // float64, shaped like the reference's
};

inline LnBound layer_norm_bound(const LnResult& ref, const at::Tensor& s, const at::Tensor& weight,
                                const at::Tensor& bias, double eps, const at::Tensor& dy,
                                const at::Tensor& dsum, double out_unit, double weight_unit = 0) {
  constexpr double u = 0x1p-24;
  auto gamma = [](double k) { return k * u / (1 - k * u); };
  const int64_t n = s.size(-1);
  const at::Tensor s64 = s.to(at::kDouble).reshape({-1, n}),
                   dy64 = dy.to(at::kDouble).reshape({-1, n});
  const at::Tensor w = weight.to(at::kDouble).abs(), b = bias.to(at::kDouble).abs();
  const at::Tensor var = s64.var(-1, /*unbiased=*/false, /*keepdim=*/true);
  const at::Tensor r = (var + eps).rsqrt();
  const at::Tensor mag_s = s64.abs() + s64.abs().mean(-1, true);  // |s| + mean|s|
  const double rows = static_cast<double>(s64.size(0)), k = 3.0 * static_cast<double>(n) + 16;
  const at::Tensor g = (dy64 * weight.to(at::kDouble)).abs();
  const at::Tensor my = w * r * mag_s + b;
  const at::Tensor mdx =
      r * g + r * g.mean(-1, true) + r.pow(3) * mag_s * (g * mag_s).mean(-1, true);
  constexpr double kSecondOrder = 1 + 1e-3;
  LnBound out;
  out.y = kSecondOrder *
          ((gamma(k) + weight_unit) * my + out_unit * ref.y.abs().reshape({-1, n})).view_as(ref.y);
  at::Tensor edx = gamma(k) * mdx + out_unit * ref.dx.abs().reshape({-1, n});
  if (dsum.defined())
    edx = edx + u * (ref.dx.abs().reshape({-1, n}) + dsum.to(at::kDouble).abs().reshape({-1, n}));
  out.dx = kSecondOrder * edx.view_as(ref.dx);
  out.dweight = kSecondOrder * gamma(rows + k) * (dy64.abs() * r * mag_s).sum(0);
  out.dbias = kSecondOrder * gamma(rows) * dy64.abs().sum(0);
  return out;
}

}  // namespace parallax::kernels::testing
