// A reference for the FP8 tests, written from the OCP FP8 specification rather than from ATen:
// the value of each of the 256 bit patterns of E4M3 (bias 7, no infinities, S.1111.111 is NaN)
// and E5M2 (bias 15, IEEE-like: exponent 31 is inf/NaN), and round-to-nearest-even onto those
// values with saturation at the largest finite one, as torchao's to_fp8_saturated specifies.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace parallax::testing::fp8 {

// The value of FP8 bit pattern `bits` (e4m3: true for E4M3, false for E5M2).
inline double decode(uint8_t bits, bool e4m3) {
  const int sign = bits >> 7;
  const int exp_bits = e4m3 ? 4 : 5, man_bits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
  const int e = (bits >> man_bits) & ((1 << exp_bits) - 1);
  const int m = bits & ((1 << man_bits) - 1);
  double v;
  if (e4m3 && e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (!e4m3 && e == 31) {
    if (m != 0) return std::numeric_limits<double>::quiet_NaN();
    v = std::numeric_limits<double>::infinity();
  } else if (e == 0) {
    v = std::ldexp(m, 1 - bias - man_bits);  // subnormal
  } else {
    v = std::ldexp((1 << man_bits) + m, e - bias - man_bits);
  }
  return sign ? -v : v;
}

// The bit pattern saturate(v) rounds to: the nearest finite value of v's sign, ties to the even
// mantissa. NaN: 0x7f (a NaN in both formats; compare NaN through decode()).
inline uint8_t round_saturated(double v, bool e4m3) {
  if (std::isnan(v)) return 0x7f;
  const double fmax = e4m3 ? 448.0 : 57344.0;
  if (v > fmax) v = fmax;
  if (v < -fmax) v = -fmax;
  int best = -1;
  double best_err = 0;
  for (int b = 0; b < 256; ++b) {
    const double d = decode(static_cast<uint8_t>(b), e4m3);
    if (!std::isfinite(d)) continue;
    if ((b & 0x80) != (std::signbit(v) ? 0x80 : 0)) continue;  // same sign, zeros included
    const double err = std::fabs(d - v);
    if (best < 0 || err < best_err || (err == best_err && (b & 1) == 0 && (best & 1) == 1)) {
      best = b;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best);
}

}  // namespace parallax::testing::fp8
