// The view transformer: lifts per-camera image features into a BEV grid through the real camera
// geometry (BEVFormer-style spatial cross-attention without learned offsets).
//
// Each BEV query cell owns a pillar of reference points at fixed heights above the ground. Every
// point is projected into every camera with the batch's intrinsics and cam_to_ego (inverted);
// image features are sampled bilinearly (grid_sample, align_corners=false, so the normalised
// coordinate is 2u/W - 1) where the point is visible (docs/data.md: depth > 0.1 m, inside the
// image) and averaged over the cameras that see it. The per-height means (and a seen/unseen flag
// per height) are concatenated and mapped by an MLP (1x1 convs) to the BEV channels, plus a
// learned per-cell query embedding. Each camera samples only the reference points it sees
// (compacted per camera, then scatter-added), so the sampling work is ~1/5 of sampling every
// point in every camera of a surround rig; sample() synchronises with the device once to size
// the compacted batches. On CUDA the forward instead runs kernels::bev_sample (every point in every
// camera that sees it, fused with the mean and the seen flags; no host sync), unless
// fused_kernels is false.
#pragma once

#include "models/bev_grid.h"
#include "models/layers.h"

#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

#include <vector>

namespace parallax::models {

struct ViewTransformerOptions {
  int64_t in_channels = 64;                              // image feature channels
  int64_t channels = 64;                                 // BEV channels
  std::vector<double> heights = {0.0, 0.67, 1.33, 2.0};  // metres above the ground (ego z)
  BevGrid grid;                                          // the BEV query grid
  int64_t image_h = 128, image_w = 224;  // pixels; the feature maps cover the image exactly
  // On CUDA, sample and average with kernels/bev_sample's fused kernels (one pass forward and
  // backward, no host sync) instead of the compacted ATen path of sample().
  bool fused_kernels = true;
  // Pixels the feature maps cover (0: the image). More than the image for a ViT that pads to whole
  // patches (models/vit.h, pad_to_patch): pixel u then lies at u / span_w of the map's width.
  int64_t span_h = 0, span_w = 0;
  int64_t map_h() const { return span_h > 0 ? span_h : image_h; }
  int64_t map_w() const { return span_w > 0 ? span_w : image_w; }
};

class ViewTransformerImpl : public torch::nn::Module {
 public:
  explicit ViewTransformerImpl(const ViewTransformerOptions& o);

  struct Sampled {
    at::Tensor features;  // [B, C, Z, Q]: visibility-weighted mean over cameras (0 where unseen)
    at::Tensor count;     // float32 [B, Z, Q]: cameras that see each reference point
  };

  // The sampling step alone. features: [B*N, C, Hf, Wf] (camera-major within a sample),
  // intrinsics [B, N, 3, 3], cam_to_ego [B, N, 4, 4]. Q = nx * ny cells in i * ny + j order.
  Sampled sample(const at::Tensor& features, const at::Tensor& intrinsics,
                 const at::Tensor& cam_to_ego) const;
  // BEV features [B, channels, nx, ny].
  at::Tensor forward(const at::Tensor& features, const at::Tensor& intrinsics,
                     const at::Tensor& cam_to_ego);
  // forward() as ONNX nodes for `cameras` cameras: every reference point sampled in every camera
  // (GridSample), weighted by visibility and averaged, as kernels::bev_sample's reference does
  // (models/onnx/bev_onnx.cpp). features in e.dtype(); intrinsics and cam_to_ego float32.
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& features,
                        const onnx::Value& intrinsics, const onnx::Value& cam_to_ego,
                        int64_t cameras);

  // Reference points, float32 [Z * Q, 3] in the ego frame (height-major), on `device`.
  at::Tensor reference_points(const c10::Device& device) const;
  const ViewTransformerOptions& options() const { return opts_; }
  Cost cost() const { return analytic_cost(opts_); }
  static Cost analytic_cost(const ViewTransformerOptions& o);

 private:
  ViewTransformerOptions opts_;
  QuantConv2d lift1_{nullptr}, lift2_{nullptr};
  torch::nn::GroupNorm norm_{nullptr};
  at::Tensor query_embed_;  // [1, C, nx, ny]
};
TORCH_MODULE(ViewTransformer);

}  // namespace parallax::models
