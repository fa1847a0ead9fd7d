// Image backbones of the perception model, shared by all cameras: a ViT (models/vit.h) or a small
// ResNet-style conv net, each followed by a neck that projects to the BEV channel count. Input
// images are normalised [B*N, 3, H, W] (any memory format); output feature maps are
// [B*N, C, H/s, W/s] with s the backbone stride (ViT: the patch size; conv: 2^stages), in
// channels-last memory format for the ViT (a free view of its tokens).
#pragma once

#include "models/layers.h"
#include "models/vit.h"

#include <torch/nn/modules/container/modulelist.h>

#include <string>
#include <vector>

namespace parallax::models {

// Stage s: a stride-2 3x3 ConvNormAct to widths[s], then blocks[s] ResidualConvBlocks.
struct ConvBackboneSpec {
  std::vector<int64_t> widths = {24, 48, 96};
  std::vector<int64_t> blocks = {0, 1, 1};
};

struct ImageEncoderOptions {
  std::string backbone = "conv";  // "vit" | "conv"
  VitSpec vit;
  ConvBackboneSpec conv;
  int64_t image_h = 128, image_w = 224;
  int64_t out_channels = 64;
  LinearFactory linear = dense_linear;
};

// Backbone + neck (ViT: LayerNorm'd tokens -> Linear; conv: 1x1 conv with bias).
class ImageEncoderImpl : public torch::nn::Module {
 public:
  explicit ImageEncoderImpl(const ImageEncoderOptions& o);
  at::Tensor forward(const at::Tensor& images);
  // forward() of normalised images [B, 3, H, W] in e.dtype() as ONNX nodes (models/onnx/bev_onnx.cpp).
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& images);

  int64_t stride() const { return stride_of(opts_); }
  int64_t feat_h() const { return opts_.image_h / stride(); }
  int64_t feat_w() const { return opts_.image_w / stride(); }
  // The residual/transformer blocks, in forward order.
  std::vector<std::shared_ptr<Block>> blocks() const { return blocks_; }
  // Cost of one image.
  Cost cost() const { return analytic_cost(opts_); }
  static Cost analytic_cost(const ImageEncoderOptions& o);
  static int64_t stride_of(const ImageEncoderOptions& o);

 private:
  ImageEncoderOptions opts_;
  VisionTransformer vit_{nullptr};
  DenseLinear vit_neck_{nullptr};
  torch::nn::Sequential conv_{nullptr};
  torch::nn::Conv2d conv_neck_{nullptr};
  std::vector<std::shared_ptr<Block>> blocks_;
};
TORCH_MODULE(ImageEncoder);

}  // namespace parallax::models
