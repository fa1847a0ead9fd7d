// Test helper: rounding bounds of kernels::bev_sample's ATen path (and of the float64 references
// it is checked against), shared by the kernel test and the view transformer's, which samples the
// same way. The bilinear taps of a pixel are written out by hand (grid_sample's
// align_corners=false, zero-padding convention: feature pixel centres at i + 0.5).
#pragma once

#include "tests/common/tolerance.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace parallax::kernels::testing {

// The bilinear taps of image pixel (u, v) in an fh x fw feature map covering image_h x image_w
// pixels: feature coordinate u * fw / image_w - 0.5 (centres at i + 0.5), taps outside the map
// dropped (zero padding).
struct Tap {
  int64_t y, x;
  double w;
};

inline std::vector<Tap> taps(double u, double v, int64_t fh, int64_t fw, int64_t image_h,
                             int64_t image_w) {
  const double x = u * static_cast<double>(fw) / static_cast<double>(image_w) - 0.5;
  const double y = v * static_cast<double>(fh) / static_cast<double>(image_h) - 0.5;
  const double x0 = std::floor(x), y0 = std::floor(y), ax = x - x0, ay = y - y0;
  std::vector<Tap> out;
  for (int dy = 0; dy < 2; ++dy) {
    for (int dx = 0; dx < 2; ++dx) {
      const int64_t xi = static_cast<int64_t>(x0) + dx, yi = static_cast<int64_t>(y0) + dy;
      if (xi < 0 || xi >= fw || yi < 0 || yi >= fh) continue;
      out.push_back({yi, xi, (dx == 1 ? ax : 1 - ax) * (dy == 1 ? ay : 1 - ay)});
    }
  }
  return out;
}

// Rounding bounds of bev_sample's ATen path (fp32, u = 2^-24) or of the float64 references
// (u = 2^-53), from the arithmetic (tests/common/tolerance.h, tests/TOLERANCES.md):
// - A tap position ix = ((g + 1) Wf - 1) / 2 with g = u_px * (2 / W) - 1 (grid_sample's
//   align_corners=false) is computed with |g| <= 1.2 and |u_px * 2 / W| <= 2.2: g errs by
//   5.6 u, g + 1 by 7.8 u, the product by 10 u Wf, the rest by 2.2 u Wf: under `coord` = 16 u
//   max(Hf, Wf) feature pixels per axis. A bilinear sample moves by at most 2 max|f| per pixel
//   per axis, so by 4 coord max|f|.
// - Its weights (1 - a) and products, and the sum of 4 taps: 6 roundings of sum w |f| <= max|f|;
//   the sum over N cameras and the division by the count: N + 2 more, of a mean bounded by max|f|.
inline double coord_error(int64_t fh, int64_t fw, double u) {
  return 16 * u * static_cast<double>(std::max(fh, fw));
}

inline double lifted_bound(const at::Tensor& features, int64_t n, double u) {
  const double fmax = features.abs().max().item<double>();
  return fmax * (4 * coord_error(features.size(2), features.size(3), u) +
                 parallax::testing::gamma_k(n + 8, u));
}

// The gradient w.r.t. the features of sum(lifted * w), elementwise: each visible (sample, camera,
// point) adds w_tap W / count to each of its taps' pixels (W: the upstream weight of the point's
// channel). A tap weight errs by at most 2 coord (both axes) plus 2 roundings, and a pixel within
// coord of a tap boundary may gain or lose a tap of weight <= 2 coord: so every pixel of the taps
// at positions x +- coord, y +- coord gets 2 coord |W| / count + gamma(2) w |W| / count, and the
// accumulation of its M contributions in any order (atomics on a GPU, index_add here) adds
// gamma(M + 1) of their sum (the + 1: the division by the count).
inline at::Tensor gradient_bound(const at::Tensor& features, const at::Tensor& uv,
                                 const at::Tensor& visible, const at::Tensor& w, int64_t z,
                                 int64_t image_h, int64_t image_w, double u) {
  const int64_t b = uv.size(0), n = uv.size(1), p = uv.size(2), q = p / z;
  const int64_t c = features.size(1), fh = features.size(2), fw = features.size(3);
  const double coord = coord_error(fh, fw, u);
  const at::Tensor uv64 = uv.to(at::kDouble).contiguous(),
                   w64 = w.to(at::kDouble).abs().contiguous();
  const auto pix = uv64.accessor<double, 4>();
  const auto up = w64.accessor<double, 3>();
  const at::Tensor vis_cpu = visible.contiguous();
  const auto vis = vis_cpu.accessor<bool, 3>();
  at::Tensor perturb = at::zeros({b * n, c, fh, fw}, at::kDouble), terms = at::zeros_like(perturb),
             count_terms = at::zeros({b * n, fh, fw}, at::kDouble);
  auto pert = perturb.accessor<double, 4>();
  auto term = terms.accessor<double, 4>();
  auto cnt = count_terms.accessor<double, 3>();
  const double scale_x = static_cast<double>(image_w) / static_cast<double>(fw),
               scale_y = static_cast<double>(image_h) / static_cast<double>(fh);
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t pi = 0; pi < p; ++pi) {
      int64_t seen_by = 0;
      for (int64_t cam = 0; cam < n; ++cam) seen_by += vis[bi][cam][pi] ? 1 : 0;
      for (int64_t cam = 0; cam < n; ++cam) {
        if (!vis[bi][cam][pi]) continue;
        const double px = pix[bi][cam][pi][0], py = pix[bi][cam][pi][1];
        std::set<std::pair<int64_t, int64_t>> hit;
        for (double dx : {-coord, coord}) {
          for (double dy : {-coord, coord}) {
            for (const Tap& t :
                 taps(px + dx * scale_x, py + dy * scale_y, fh, fw, image_h, image_w))
              hit.insert({t.y, t.x});
          }
        }
        std::map<std::pair<int64_t, int64_t>, double> exact;
        for (const Tap& t : taps(px, py, fh, fw, image_h, image_w)) exact[{t.y, t.x}] = t.w;
        for (const auto& yx : hit) {
          const double tw = exact.count(yx) ? exact.at(yx) : 0.0;
          cnt[bi * n + cam][yx.first][yx.second] += 1;
          for (int64_t ci = 0; ci < c; ++ci) {
            const double wp = up[bi][ci * z + pi / q][pi % q] / static_cast<double>(seen_by);
            pert[bi * n + cam][ci][yx.first][yx.second] +=
                wp * (2 * coord + parallax::testing::gamma_k(2, u) * tw);
            term[bi * n + cam][ci][yx.first][yx.second] += wp * tw;
          }
        }
      }
    }
  }
  const at::Tensor m = count_terms.unsqueeze(1) + 1;
  return perturb + terms * (m * u / (1 - m * u));
}

}  // namespace parallax::kernels::testing
