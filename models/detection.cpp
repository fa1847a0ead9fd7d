#include "models/detection.h"

#include <ATen/ATen.h>

namespace parallax::models {

DetectionTargets encode_detection_targets(const at::Tensor& boxes, const BevGrid& grid,
                                          int64_t num_classes, const at::Tensor& velocities) {
  const at::Tensor bx = boxes.to(at::kFloat);
  const int64_t b = bx.size(0), k = bx.size(1);
  const auto f32 = bx.options();
  auto col = [&](int64_t c) { return bx.select(-1, c); };
  const at::Tensor gx = (col(0) - grid.x_min) / grid.resolution;
  const at::Tensor gy = (col(1) - grid.y_min) / grid.resolution;
  const at::Tensor ci = gx.floor(), cj = gy.floor();
  const at::Tensor cls = col(7);
  const at::Tensor mask = (cls >= 0) & (cls < static_cast<double>(num_classes)) & (col(8) > 0) &
                          (ci >= 0) & (ci < static_cast<double>(grid.nx)) & (cj >= 0) &
                          (cj < static_cast<double>(grid.ny));
  const at::Tensor index =
      at::where(mask, ci * static_cast<double>(grid.ny) + cj, at::zeros_like(ci)).to(at::kLong);
  auto safe_log = [](const at::Tensor& v) { return v.clamp_min(1e-3).log(); };
  const at::Tensor codes = at::stack({gx - ci, gy - cj, col(2), safe_log(col(3)), safe_log(col(4)),
                                      safe_log(col(5)), col(6).sin(), col(6).cos()},
                                     -1);

  at::Tensor heatmap = at::zeros({b, num_classes, grid.nx, grid.ny}, f32);
  if (k > 0) {
    const at::Tensor diag = (col(3).pow(2) + col(4).pow(2)).sqrt();
    const at::Tensor sigma = (diag / (6.0 * grid.resolution)).clamp_min(0.8);  // cells, [B, K]
    const at::Tensor ii = at::arange(grid.nx, f32).view({1, 1, -1, 1});
    const at::Tensor jj = at::arange(grid.ny, f32).view({1, 1, 1, -1});
    auto e = [](const at::Tensor& t) { return t.unsqueeze(-1).unsqueeze(-1); };
    const at::Tensor d2 = (ii - e(ci)).pow(2) + (jj - e(cj)).pow(2);  // [B, K, nx, ny]
    const at::Tensor g = at::exp(-d2 / (2 * e(sigma).pow(2))) * e(mask.to(at::kFloat));
    std::vector<at::Tensor> per_class;
    per_class.reserve(num_classes);
    for (int64_t c = 0; c < num_classes; ++c) {
      per_class.push_back((g * e((cls == static_cast<double>(c)).to(at::kFloat))).amax(1));
    }
    heatmap = at::stack(per_class, 1);
  }
  DetectionTargets t{heatmap, codes, index, mask, {}, {}};
  if (velocities.defined()) {
    const at::Tensor v = velocities.to(bx.device(), at::kFloat);
    t.velocity_mask = v.isfinite() & mask.unsqueeze(-1);
    t.velocity = at::where(t.velocity_mask, v, at::zeros_like(v));
  }
  return t;
}

namespace {

// A loss's normaliser: the count, or its mean over the replicas, at least 1.
at::Tensor normaliser(const at::Tensor& count, const ReplicaMean& mean) {
  return (mean ? mean(count) : count).clamp_min(1);
}

}  // namespace

at::Tensor heatmap_focal_loss(const at::Tensor& logits, const at::Tensor& target,
                              const ReplicaMean& mean) {
  const at::Tensor x = logits.to(at::kFloat);
  const at::Tensor t = target.to(at::kFloat);
  const at::Tensor pos = t.eq(1).to(at::kFloat);
  const at::Tensor p = at::sigmoid(x);
  const at::Tensor pos_term = (1 - p).pow(2) * at::log_sigmoid(x) * pos;
  const at::Tensor neg_term = (1 - t).pow(4) * p.pow(2) * at::log_sigmoid(-x) * (1 - pos);
  return -(pos_term.sum() + neg_term.sum()) / normaliser(pos.sum(), mean);
}

at::Tensor box_regression_loss(const at::Tensor& box_reg, const DetectionTargets& targets,
                               const ReplicaMean& mean) {
  const int64_t b = box_reg.size(0), k = targets.index.size(1), c = box_reg.size(1);
  const at::Tensor flat = box_reg.reshape({b, c, -1});
  const at::Tensor idx = targets.index.unsqueeze(1).expand({b, c, k});
  const at::Tensor pred = flat.gather(2, idx).transpose(1, 2).to(at::kFloat);  // [B, K, c]
  const at::Tensor m = targets.mask.to(at::kFloat);
  at::Tensor l1 = (pred.narrow(-1, 0, kBoxCodeSize) - targets.codes).abs().sum(-1) * m;
  if (c == kBoxCodeSize + kVelocityCodeSize && targets.velocity.defined()) {
    const at::Tensor dv =
        (pred.narrow(-1, kBoxCodeSize, kVelocityCodeSize) - targets.velocity).abs();
    l1 = l1 + kVelocityCodeWeight * (dv * targets.velocity_mask.to(at::kFloat)).sum(-1);
  }
  return l1.sum() / normaliser(m.sum(), mean);
}

Detections decode_detections(const at::Tensor& heatmap_logits, const at::Tensor& box_reg,
                             const BevGrid& grid, int64_t max_detections, double score_threshold) {
  const at::Tensor heat = at::sigmoid(heatmap_logits.to(at::kFloat));
  const int64_t b = heat.size(0), c = heat.size(1), q = grid.cells();
  const at::Tensor peak =
      heat * (heat == at::max_pool2d(heat, {3, 3}, {1, 1}, {1, 1})).to(at::kFloat);
  const int64_t k = std::min(max_detections, c * q);
  auto [scores, idx] = peak.reshape({b, c * q}).topk(k, 1);
  const at::Tensor cls = at::div(idx, q, "floor");
  const at::Tensor cell = idx.remainder(q);
  const int64_t nc = box_reg.size(1);
  const at::Tensor codes = box_reg.reshape({b, nc, q})
                               .gather(2, cell.unsqueeze(1).expand({b, nc, k}))
                               .transpose(1, 2)
                               .to(at::kFloat);  // [B, k, nc]
  const at::Tensor i = at::div(cell, grid.ny, "floor").to(at::kFloat),
                   j = cell.remainder(grid.ny).to(at::kFloat);
  auto code = [&](int64_t e) { return codes.select(-1, e); };
  const at::Tensor box = at::stack(
      {grid.x_min + (i + code(0)) * grid.resolution, grid.y_min + (j + code(1)) * grid.resolution,
       code(2), code(3).exp(), code(4).exp(), code(5).exp(), at::atan2(code(6), code(7)),
       cls.to(at::kFloat), at::ones_like(code(0))},
      -1);
  const at::Tensor keep = scores >= score_threshold;
  at::Tensor pad = at::zeros({9}, box.options());
  pad[7] = -1;
  at::Tensor out_boxes = at::where(keep.unsqueeze(-1), box, pad);
  at::Tensor out_scores = at::where(keep, scores, at::zeros_like(scores));
  at::Tensor out_vel;
  if (nc == kBoxCodeSize + kVelocityCodeSize) {
    out_vel = at::where(keep.unsqueeze(-1), codes.narrow(-1, kBoxCodeSize, kVelocityCodeSize),
                        at::zeros({kVelocityCodeSize}, box.options()));
  }
  if (k < max_detections) {
    const int64_t extra = max_detections - k;
    out_boxes = at::cat({out_boxes, pad.expand({b, extra, 9})}, 1);
    out_scores = at::cat({out_scores, at::zeros({b, extra}, out_scores.options())}, 1);
    if (out_vel.defined())
      out_vel = at::cat({out_vel, at::zeros({b, extra, kVelocityCodeSize}, out_vel.options())}, 1);
  }
  return {out_boxes, out_scores, out_vel};
}

}  // namespace parallax::models
