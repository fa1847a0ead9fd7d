// Image backbones of the perception model, shared by all cameras: a ViT (models/vit.h) or a small
// ResNet-style conv net, each followed by a neck that projects to the BEV channel count. Input
// images are normalised [B*N, 3, H, W] (any memory format); output feature maps are
// [B*N, C, H/s, W/s] with s the backbone stride (ViT: the patch size; conv: 2^stages), in
// channels-last memory format for the ViT (a free view of its tokens).
#pragma once

#include "models/layers.h"
#include "models/model.h"
#include "models/vit.h"

#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

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
  units::TpLayersPtr tp = nullptr;  // ViT: tensor-parallel blocks (models/vit.h)
};

// Backbone + neck (ViT: LayerNorm'd tokens -> Linear; conv: 1x1 conv with bias).
class ImageEncoderImpl : public torch::nn::Module {
 public:
  explicit ImageEncoderImpl(const ImageEncoderOptions& o);
  at::Tensor forward(const at::Tensor& images);

  // The encoder as model units (models/model.h), for a model that runs it unit by unit:
  // forward_unit(0, images), then forward_unit(i, previous output) for i < num_units(), equals
  // forward(images). ViT: the embedding (images -> tokens), each transformer block, then the final
  // LayerNorm with the neck (tokens -> feature map); conv: one unit, the whole backbone and neck.
  int64_t num_units() const { return vit_ ? static_cast<int64_t>(blocks_.size()) + 2 : 1; }
  at::Tensor forward_unit(int64_t index, const at::Tensor& x);
  // Unit names and the module paths each owns, for this module registered at `path` ("encoder"):
  // ViT "<path>.vit.embed", "<path>.vit.block<i>", "<path>.neck"; conv "<path>".
  std::vector<UnitPaths> unit_paths(const std::string& path) const;
  // The dtype forward_unit(0, ...) takes images in: its own parameters' dtype.
  at::ScalarType param_dtype() const {
    return vit_ ? vit_->param_dtype() : conv_neck_->weight.scalar_type();
  }
  // forward_unit(index, x) as ONNX nodes, x in e.dtype() (unit 0 takes normalised images
  // [B, 3, H, W]; models/onnx/bev_onnx.cpp).
  onnx::Value emit_unit(onnx::Emitter& e, int64_t index, const onnx::Value& x);

  int64_t stride() const { return stride_of(opts_); }
  // The feature map's size: image / stride, rounded up for a ViT that pads to whole patches, whose
  // map then covers feat * stride pixels, more than the image (span_h(), span_w()).
  int64_t feat_h() const;
  int64_t feat_w() const;
  int64_t span_h() const { return feat_h() * stride(); }
  int64_t span_w() const { return feat_w() * stride(); }
  // The ViT (null for other backbones): model.pretrained's load reads its geometry.
  const VisionTransformerImpl* vit() const { return vit_.is_empty() ? nullptr : vit_.get(); }
  // The residual/transformer blocks, in forward order.
  std::vector<std::shared_ptr<Block>> blocks() const { return blocks_; }
  // Cost of one image.
  Cost cost() const { return analytic_cost(opts_); }
  static Cost analytic_cost(const ImageEncoderOptions& o);
  static int64_t stride_of(const ImageEncoderOptions& o);

 private:
  at::Tensor vit_neck(const at::Tensor& tokens);

  ImageEncoderOptions opts_;
  VisionTransformer vit_{nullptr};
  DenseLinear vit_neck_{nullptr};
  torch::nn::Sequential conv_{nullptr};
  QuantConv2d conv_neck_{nullptr};
  std::vector<std::shared_ptr<Block>> blocks_;
};
TORCH_MODULE(ImageEncoder);

}  // namespace parallax::models
