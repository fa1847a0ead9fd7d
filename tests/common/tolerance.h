// Test helper: the rounding units and error constants that numeric tolerances in tests/ are derived
// from, and an elementwise check against a derived bound that names the worst element. Every bound
// is written out beside its assertion; tests/TOLERANCES.md lists them all.
//
// The model of floating-point arithmetic (Higham, "Accuracy and Stability of Numerical
// Algorithms", 2nd ed., ch. 2-3): a basic operation (+ - * / sqrt, fma) is correctly rounded, so
// its result is within u |exact| (u: unit roundoff, 2^-p for p significant bits). A sum or dot
// product of k terms, in ANY order, blocking or threading (so whatever BLAS kernel, SIMD width or
// reduction tree a CPU or GPU picks), is within gamma(k) * sum |terms| of the exact value (Higham
// eq. 3.5, Lemma 3.1). Bounds are written relative to magnitudes (sums of absolute values of the
// terms), never to the computed value, so cancellation cannot break them.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <sstream>

namespace parallax::testing {

// Unit roundoff 2^-p, p = significant bits including the implicit one.
inline constexpr double kFp64Unit = 0x1p-53;
inline constexpr double kFp32Unit = 0x1p-24;
inline constexpr double kFp16Unit = 0x1p-11;
inline constexpr double kBf16Unit = 0x1p-8;
// fp32's unit roundoff under the name the derivations use (`using tol::u;` in a test file).
inline constexpr double u = kFp32Unit;

inline double unit_roundoff(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return kFp64Unit;
    case at::kHalf:
      return kFp16Unit;
    case at::kBFloat16:
      return kBf16Unit;
    default:
      return kFp32Unit;
  }
}

// gamma_k = k u / (1 - k u): the relative bound of k accumulated roundings (k u < 1).
inline double gamma_k(double k, double u = kFp32Unit) {
  return k * u / (1 - k * u);
}

// |a - b| <= bound elementwise (bound broadcasts; computed in float64). NaN anywhere fails. The
// message names the worst element (largest |a - b| - bound) and how far over its bound it is.
inline ::testing::AssertionResult within(const at::Tensor& a, const at::Tensor& b,
                                         const at::Tensor& bound) {
  if (a.sizes() != b.sizes())
    return ::testing::AssertionFailure() << "sizes " << a.sizes() << " vs " << b.sizes();
  if (a.numel() == 0) return ::testing::AssertionSuccess();
  const at::Tensor a64 = a.detach().cpu().to(at::kDouble), b64 = b.detach().cpu().to(at::kDouble);
  const at::Tensor lim = bound.detach().cpu().to(at::kDouble).expand_as(a64);
  const at::Tensor diff = (a64 - b64).abs();
  const at::Tensor excess =
      at::where(at::isnan(diff) | at::isnan(lim), at::full({}, INFINITY, a64.options()), diff - lim)
          .flatten();
  const int64_t worst = excess.argmax().item<int64_t>();
  if (excess[worst].item<double>() <= 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os << "element " << worst << " of " << a.sizes() << ": " << a64.flatten()[worst].item<double>()
     << " vs " << b64.flatten()[worst].item<double>() << ", |diff| "
     << diff.flatten()[worst].item<double>() << " > bound " << lim.flatten()[worst].item<double>()
     << " (" << (diff > lim).sum().item<int64_t>() << " elements over)";
  return ::testing::AssertionFailure() << os.str();
}

inline ::testing::AssertionResult within(const at::Tensor& a, const at::Tensor& b, double bound) {
  return within(a, b, at::full({}, bound, at::kDouble));
}

}  // namespace parallax::testing
