// The ResNet-50/101 image trunk of the bev model (model.backbone=resnet50|resnet101) and its FPN
// neck, as BEVDet and mmdetection3d train a camera backbone: torchvision's ResNet v1.5 (the stride
// on the Bottleneck's 3x3 conv2, expansion 4, stages [3, 4, 6, 3] or [3, 4, 23, 3]) with its exact
// parameter and buffer names (conv1, bn1, layer<s>.<b>.conv1 ... .downsample.{0,1}; no fc), so
// torchvision's state_dict loads name for name; batch norms frozen to their running statistics
// (norm_eval=True); a single-output FPN at stride 16.
//
// Input: normalised images [B*N, 3, H, W] with H and W divisible by 32 (the stride of C5); output
// of the FPN: [B*N, out_channels, H/16, W/16].
#pragma once

#include "models/layers.h"
#include "models/onnx/emitter.h"

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace parallax::models {

// Batch norm frozen to its running statistics (torchvision's FrozenBatchNorm2d, with the names of
// torch.nn.BatchNorm2d): y = (x - running_mean) / sqrt(running_var + eps) * weight + bias in
// training and evaluation alike. "weight" and "bias" [C] are trainable parameters (1 and 0 at
// construction); "running_mean" [C] (0), "running_var" [C] (1) and "num_batches_tracked" (int64
// scalar, 0; kept only so that a torchvision state_dict maps one to one) are buffers the forward
// never changes. The per-channel scale and shift are computed in float32 from the parameters'
// dtype, then applied in x's dtype as one fused multiply-add (so under bf16 autocast the output
// stays 16-bit, as the convolution's).
class FrozenBatchNorm2dImpl : public torch::nn::Module {
 public:
  explicit FrozenBatchNorm2dImpl(int64_t channels, double eps = 1e-5);
  at::Tensor forward(const at::Tensor& x);
  // BatchNormalization in inference form (models/onnx/resnet_onnx.cpp).
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& x);
  double eps() const { return eps_; }

  at::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  double eps_;
};
TORCH_MODULE(FrozenBatchNorm2d);

// torchvision's Bottleneck (v1.5): conv1 1x1 -> bn1 -> relu -> conv2 3x3 (stride) -> bn2 -> relu
// -> conv3 1x1 (x4) -> bn3, plus the identity or downsample (1x1 conv with the stride, bn), then
// relu. Convolutions without bias. A Block, so activation recompute wraps each bottleneck.
//
// QAT (train/qat/qat.h): add_quantizers() registers "add_quantizer", one per-tensor quantizer
// shared by both inputs of the residual Add (the conv branch, then the identity or downsample), as
// ResidualConvBlock's (models/layers.h), so an INT8 engine can run the Add in INT8. Empty without.
class Bottleneck : public Block {
 public:
  static constexpr int64_t kExpansion = 4;
  // `in` channels at in_h x in_w; `width` the 3x3's channels; out = width * 4 at in / stride.
  Bottleneck(int64_t in, int64_t width, int64_t stride, int64_t in_h, int64_t in_w);
  at::Tensor forward_impl(const at::Tensor& x) override;
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& x) override;
  Cost cost() const override { return analytic_cost(in_, width_, stride_, in_h_, in_w_); }
  static Cost analytic_cost(int64_t in, int64_t width, int64_t stride, int64_t in_h, int64_t in_w);
  bool has_downsample() const { return !downsample_.is_empty(); }
  // parallax::Error when it has them already.
  void add_quantizers(bool learn_scales = false);
  bool quantized() const { return !add_quantizer.is_empty(); }

  TensorQuantizer add_quantizer{nullptr};

 private:
  int64_t in_, width_, stride_, in_h_, in_w_;
  QuantConv2d conv1_{nullptr}, conv2_{nullptr}, conv3_{nullptr};
  FrozenBatchNorm2d bn1_{nullptr}, bn2_{nullptr}, bn3_{nullptr};
  torch::nn::Sequential downsample_{nullptr};  // "0": conv, "1": FrozenBatchNorm2d
  QuantConv2d ds_conv_{nullptr};
  FrozenBatchNorm2d ds_bn_{nullptr};
};

// The stages of ResNet-`depth` (50: [3, 4, 6, 3], 101: [3, 4, 23, 3]); ConfigError naming
// model.backbone otherwise.
std::vector<int64_t> resnet_layers(int64_t depth);

// torchvision's ResNet trunk without avgpool and fc. stem(): conv1 7x7/2, bn1, relu, maxpool
// 3x3/2 (stride 4, 64 channels); layer(s, x) for s in 1..4 (C2..C5: 256, 512, 1024, 2048 channels
// at stride 4, 8, 16, 32).
class ResNetImpl : public torch::nn::Module {
 public:
  ResNetImpl(int64_t depth, int64_t image_h, int64_t image_w);
  at::Tensor stem(const at::Tensor& images);
  at::Tensor layer(int64_t s, const at::Tensor& x);
  // stem, then the stage's bottlenecks, as ONNX nodes (inside this module's scope).
  onnx::Value emit_stem(onnx::Emitter& e, const onnx::Value& images);
  onnx::Value emit_layer(onnx::Emitter& e, int64_t s, const onnx::Value& x);
  // Every bottleneck, in forward order.
  std::vector<std::shared_ptr<Block>> blocks() const;
  at::ScalarType param_dtype() const { return conv1_->weight.scalar_type(); }
  static Cost analytic_cost(int64_t depth, int64_t image_h, int64_t image_w);
  // Of the stem (s = 0) or of stage s (1..4) alone.
  static Cost stage_cost(int64_t depth, int64_t s, int64_t image_h, int64_t image_w);
  // Output channels of stage s (1..4).
  static int64_t channels(int64_t s) { return int64_t{64} << (s + 1); }

 private:
  int64_t depth_;
  QuantConv2d conv1_{nullptr};
  FrozenBatchNorm2d bn1_{nullptr};
  std::vector<std::vector<std::shared_ptr<Bottleneck>>> stages_;
};
TORCH_MODULE(ResNet);

// BEVDet's single-output FPN: lateral 1x1 convs (with bias) on C4 ("lateral_convs.0") and C5
// ("lateral_convs.1") to `out` channels, P4 = lateral(C4) + nearest 2x upsample of lateral(C5),
// then a 3x3 conv ("fpn_convs.0"): [.., out, H/16, W/16].
class ResNetFpnImpl : public torch::nn::Module {
 public:
  ResNetFpnImpl(int64_t c4, int64_t c5, int64_t out);
  at::Tensor forward(const at::Tensor& c4, const at::Tensor& c5);
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& c4, const onnx::Value& c5);
  // At the C4 map size h x w.
  static Cost analytic_cost(int64_t c4, int64_t c5, int64_t out, int64_t h, int64_t w);

 private:
  torch::nn::ModuleList lateral_{nullptr}, output_{nullptr};
  QuantConv2d lateral4_{nullptr}, lateral5_{nullptr}, out_conv_{nullptr};
};
TORCH_MODULE(ResNetFpn);

}  // namespace parallax::models
