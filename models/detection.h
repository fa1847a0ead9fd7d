// CenterPoint-style 3D detection on a BEV grid: target encoding from padded ground-truth boxes,
// the heatmap focal loss, the box regression L1 loss and decoding (3x3 max-pool NMS, top-K) back
// to boxes in the ego frame. All vectorised torch ops on the tensors' device (CPU or GPU).
//
// Boxes are rows (x, y, z, l, w, h, yaw, class, visibility) as in docs/data.md. A box is a
// target when its class is in [0, num_classes), its visibility is > 0 and its centre lies inside
// the grid. Its centre cell (i, j) = floor((x - x_min) / res), floor((y - y_min) / res) holds
// the regression code (dx, dy, z, log l, log w, log h, sin yaw, cos yaw), with dx, dy the centre's
// offset inside the cell in cell units ([0, 1)). The class heatmap is the max over boxes of
// Gaussians centred on the centre cells (exactly 1 there) with sigma = max(0.8, diag / (6 res))
// cells, diag = sqrt(l^2 + w^2).
//
// Velocity (model.velocity): the head regresses two more channels, the box's ground velocity
// (vx, vy) in the ego frame in m/s, as CenterPoint does, weighted 0.2 against the other entries
// (CenterPoint's and mmdetection3d's code_weights). A box whose velocity the data does not know
// (NaN) still trains its other entries; only its velocity entries are left out.
#pragma once

#include "models/bev_grid.h"
#include "models/replica_mean.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace parallax::models {

inline constexpr int64_t kBoxCodeSize = 8;       // without velocity
inline constexpr int64_t kVelocityCodeSize = 2;  // vx, vy
inline constexpr double kVelocityCodeWeight = 0.2;

// The head's regression channels: 8, or 10 with velocity.
inline int64_t box_code_size(bool velocity) {
  return kBoxCodeSize + (velocity ? kVelocityCodeSize : 0);
}

struct DetectionTargets {
  at::Tensor heatmap;  // float32 [B, C, nx, ny]
  at::Tensor codes;    // float32 [B, K, 8]
  at::Tensor index;    // int64 [B, K]: centre cell i * ny + j (0 for non-targets)
  at::Tensor mask;     // bool [B, K]: which boxes are targets
  // With velocities given: float32 [B, K, 2] (NaN replaced by 0) and bool [B, K, 2], which
  // entries are known (and the box a target); undefined otherwise.
  at::Tensor velocity, velocity_mask;
};

// `velocities` float [B, K, 2] row for row with `boxes` (NaN = unknown), or undefined.
DetectionTargets encode_detection_targets(const at::Tensor& boxes, const BevGrid& grid,
                                          int64_t num_classes,
                                          const at::Tensor& velocities = at::Tensor());

// CenterNet focal loss (alpha 2, beta 4) of heatmap logits against Gaussian targets, normalised
// by the number of centre cells (target == 1), at least 1; with `mean`, by the mean of that number
// over the data-parallel replicas (models/replica_mean.h). Computed in float32.
at::Tensor heatmap_focal_loss(const at::Tensor& logits, const at::Tensor& target,
                              const ReplicaMean& mean = {});

// L1 over the 8 code entries (summed) at each target box's centre cell, averaged over target
// boxes (0 if none; with `mean`, over the mean number of target boxes of the replicas).
// box_reg: [B, 8, nx, ny], or [B, 10, nx, ny] with velocity: the known velocity entries' L1,
// times kVelocityCodeWeight, joins each box's sum (the same normaliser).
at::Tensor box_regression_loss(const at::Tensor& box_reg, const DetectionTargets& targets,
                               const ReplicaMean& mean = {});

struct Detections {
  at::Tensor boxes;   // float32 [B, K, 9], visibility column 1, padding rows all 0 with class -1
  at::Tensor scores;  // float32 [B, K], descending, 0 for padding rows
  at::Tensor velocities;  // float32 [B, K, 2] (0 on padding rows) with a 10-channel box_reg
};

// Peaks of sigmoid(heatmap_logits) that survive a 3x3 max-pool NMS, the top `max_detections`
// over all classes, kept when score >= score_threshold, decoded with the codes at their cells.
Detections decode_detections(const at::Tensor& heatmap_logits, const at::Tensor& box_reg,
                             const BevGrid& grid, int64_t max_detections, double score_threshold);

}  // namespace parallax::models
