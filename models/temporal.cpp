#include "models/temporal.h"

#include "core/error.h"

#include <ATen/ATen.h>

namespace parallax::models {

at::Tensor align_bev(const at::Tensor& prev_bev, const at::Tensor& prev_to_current,
                     const BevGrid& grid) {
  const int64_t m = prev_bev.size(0);
  PARALLAX_CHECK(prev_to_current.dim() == 3 && prev_to_current.size(0) == m &&
                     prev_to_current.size(1) == 4 && prev_to_current.size(2) == 4,
                 Error, "model 'bev': 'prev_to_current' must be [M, 4, 4] for {} previous BEVs", m);
  // In float32 on the features' device: the poses' translations are a few tens of metres.
  const auto f32 = prev_bev.options().dtype(at::kFloat);
  const at::Tensor T = prev_to_current.to(f32);
  const at::Tensor r00 = T.select(1, 0).select(1, 0).view({m, 1, 1}),
                   r01 = T.select(1, 0).select(1, 1).view({m, 1, 1}),
                   r10 = T.select(1, 1).select(1, 0).view({m, 1, 1}),
                   r11 = T.select(1, 1).select(1, 1).view({m, 1, 1}),
                   tx = T.select(1, 0).select(1, 3).view({m, 1, 1}),
                   ty = T.select(1, 1).select(1, 3).view({m, 1, 1});
  // Current cell centres (x along dim 2, y along dim 3).
  const at::Tensor x =
      (grid.x_min + (at::arange(grid.nx, f32) + 0.5) * grid.resolution).view({1, -1, 1});
  const at::Tensor y =
      (grid.y_min + (at::arange(grid.ny, f32) + 0.5) * grid.resolution).view({1, 1, -1});
  // p_prev = R^T (c - t).
  const at::Tensor dx = x - tx, dy = y - ty;
  const at::Tensor px = r00 * dx + r10 * dy, py = r01 * dx + r11 * dy;  // [M, nx, ny]
  // grid_sample's normalised coordinates (align_corners false): -1 and 1 are the grid's outer
  // edges; its last dimension holds (along W = y, along H = x).
  const double ex = grid.resolution * static_cast<double>(grid.nx),
               ey = grid.resolution * static_cast<double>(grid.ny);
  const at::Tensor gx = (px - grid.x_min) * (2.0 / ex) - 1.0;
  const at::Tensor gy = (py - grid.y_min) * (2.0 / ey) - 1.0;
  const at::Tensor g = at::stack({gy, gx}, -1).to(prev_bev.scalar_type());
  return at::grid_sampler_2d(prev_bev, g, /*bilinear*/ 0, /*zeros*/ 0, /*align_corners=*/false);
}

TemporalFusionImpl::TemporalFusionImpl(int64_t channels, int64_t frames, int64_t nx, int64_t ny)
    : channels_(channels), frames_(frames) {
  fuse_ = register_module(
      "fuse", ConvNormAct(ConvNormActOptions{channels * frames, channels, 3, 1, true, nx, ny}));
}

at::Tensor TemporalFusionImpl::forward(const at::Tensor& current, const at::Tensor& aligned) {
  const int64_t b = current.size(0);
  PARALLAX_CHECK(aligned.dim() == 5 && aligned.size(0) == b && aligned.size(1) == frames_ - 1,
                 Error, "model 'bev': {} aligned previous BEVs per sample expected, got {}",
                 frames_ - 1, fmt::format("{}", aligned.sizes()));
  const at::Tensor prev = aligned.flatten(1, 2);  // [B, (F - 1) C, nx, ny], nearest frame first
  return fuse_->forward(at::cat({current, prev.to(current.scalar_type())}, 1));
}

Cost TemporalFusionImpl::analytic_cost(int64_t channels, int64_t frames, int64_t nx, int64_t ny) {
  return ConvNormActImpl::analytic_cost({channels * frames, channels, 3, 1, true, nx, ny});
}

onnx::Value TemporalFusionImpl::emit_onnx(onnx::Emitter& e, const onnx::Value& x) {
  auto s = e.scope("fuse");
  return fuse_->emit_onnx(e, x);
}

}  // namespace parallax::models
