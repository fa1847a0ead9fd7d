// Temporal fusion for the bev model (model.temporal; BEVDet4D's alignment, docs/models.md
// "Temporal fusion"): the BEV features of the F - 1 previous keyframes, each computed by the same
// image backbone and view transformer from that frame's images and cameras, are moved into the
// current ego frame by the ego motion and fused with the current BEV before the BEV encoder.
//
// Alignment. `prev_to_current` [M, 4, 4] is a previous ego frame's pose in the current ego frame
// (T_current^-1 T_previous: a point p in the previous frame is prev_to_current p in the current).
// The aligned previous BEV at the current cell centre c is the previous BEV sampled at
// prev_to_current^-1 c (only the rotation about z and the x, y translation are used: the BEV is a
// ground plane), bilinearly, zero outside the previous grid: one grid_sample with an affine grid.
// A static world point so lands in the same cell in every aligned frame (to within the bilinear
// weights of the cells around it).
//
// Fusion. The current BEV and the aligned previous ones (nearest first), concatenated over
// channels, go through one 3x3 ConvNormAct to the BEV channels (BEVDet4D concatenates them for
// its BEV encoder; the conv keeps the encoder's width whatever the frame count).
#pragma once

#include "models/bev_grid.h"
#include "models/layers.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>

namespace parallax::models {

// `prev_bev` [M, C, nx, ny] on `grid`, aligned to the current ego frame (above).
at::Tensor align_bev(const at::Tensor& prev_bev, const at::Tensor& prev_to_current,
                     const BevGrid& grid);

class TemporalFusionImpl : public torch::nn::Module {
 public:
  TemporalFusionImpl(int64_t channels, int64_t frames, int64_t nx, int64_t ny);
  // `current` [B, C, nx, ny], `aligned` [B, F - 1, C, nx, ny] -> [B, C, nx, ny].
  at::Tensor forward(const at::Tensor& current, const at::Tensor& aligned);
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& x);  // x: the concatenation
  static Cost analytic_cost(int64_t channels, int64_t frames, int64_t nx, int64_t ny);
  int64_t frames() const { return frames_; }

 private:
  int64_t channels_, frames_;
  ConvNormAct fuse_{nullptr};
};
TORCH_MODULE(TemporalFusion);

}  // namespace parallax::models
