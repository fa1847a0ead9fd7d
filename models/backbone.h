// Image backbones of the perception model, shared by all cameras: a ViT (models/vit.h), a small
// ResNet-style conv net, or torchvision's ResNet-50/101 (models/resnet.h), each followed by a neck
// that projects to the BEV channel count. Input images are normalised [B*N, 3, H, W] (any memory
// format); output feature maps are [B*N, C, H/s, W/s] with s the backbone stride (ViT: the patch
// size; conv: 2^stages; ResNet: 16, its FPN's output), in channels-last memory format for the ViT
// (a free view of its tokens).
#pragma once

#include "models/layers.h"
#include "models/model.h"
#include "models/resnet.h"
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
  std::string backbone = "conv";  // "vit" | "conv" | "resnet50" | "resnet101"
  VitSpec vit;
  ConvBackboneSpec conv;
  int64_t image_h = 128, image_w = 224;
  int64_t out_channels = 64;
  LinearFactory linear = dense_linear;
  units::TpLayersPtr tp = nullptr;  // ViT: tensor-parallel blocks (models/vit.h)
};

// Backbone + neck (ViT: LayerNorm'd tokens -> Linear; conv: 1x1 conv with bias; ResNet: the FPN on
// C4 and C5).
class ImageEncoderImpl : public torch::nn::Module {
 public:
  explicit ImageEncoderImpl(const ImageEncoderOptions& o);
  at::Tensor forward(const at::Tensor& images);

  // The encoder as model units (models/model.h), for a model that runs it unit by unit:
  // forward_unit(0, images), then forward_unit(i, previous output) for i < num_units(), equals
  // forward(images). ViT: the embedding (images -> tokens), each transformer block, then the final
  // LayerNorm with the neck (tokens -> feature map); conv: one unit, the whole backbone and neck;
  // ResNet: the stem with layer1, layer2, layer3 (C4), then layer4 with the FPN (C4 -> C5 -> the
  // feature map: the FPN's two inputs stay inside one unit).
  int64_t num_units() const {
    return vit_ ? static_cast<int64_t>(blocks_.size()) + 2 : (resnet_ ? 4 : 1);
  }
  at::Tensor forward_unit(int64_t index, const at::Tensor& x);
  // Unit names and the module paths each owns, for this module registered at `path` ("encoder"):
  // ViT "<path>.vit.embed", "<path>.vit.block<i>", "<path>.neck"; conv "<path>"; ResNet
  // "<path>.resnet.layer1" (with conv1, bn1), "<path>.resnet.layer2", "<path>.resnet.layer3",
  // "<path>.fpn" (with resnet.layer4).
  std::vector<UnitPaths> unit_paths(const std::string& path) const;
  // The dtype forward_unit(0, ...) takes images in: its own parameters' dtype.
  at::ScalarType param_dtype() const {
    if (vit_) return vit_->param_dtype();
    return resnet_ ? resnet_->param_dtype() : conv_neck_->weight.scalar_type();
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
  // The ResNet trunk (null for other backbones): its stages alone, for comparisons with
  // torchvision's (tests/train/backbone_tool.cpp).
  ResNetImpl* resnet() { return resnet_.is_empty() ? nullptr : resnet_.get(); }
  // The residual/transformer/bottleneck blocks, in forward order.
  std::vector<std::shared_ptr<Block>> blocks() const { return blocks_; }
  // Cost of one image.
  Cost cost() const { return analytic_cost(opts_); }
  static Cost analytic_cost(const ImageEncoderOptions& o);
  // FLOPs of one image per unit (summing to analytic_cost's), where the backbone's units differ in
  // FLOPs per parameter (ResNet); empty otherwise.
  static std::vector<double> unit_flops(const ImageEncoderOptions& o);
  static int64_t stride_of(const ImageEncoderOptions& o);
  // 50 or 101 for backbone "resnet50" / "resnet101", else 0.
  static int64_t resnet_depth(const std::string& backbone);

 private:
  at::Tensor vit_neck(const at::Tensor& tokens);

  ImageEncoderOptions opts_;
  VisionTransformer vit_{nullptr};
  DenseLinear vit_neck_{nullptr};
  torch::nn::Sequential conv_{nullptr};
  QuantConv2d conv_neck_{nullptr};
  ResNet resnet_{nullptr};
  ResNetFpn fpn_{nullptr};
  std::vector<std::shared_ptr<Block>> blocks_;
};
TORCH_MODULE(ImageEncoder);

}  // namespace parallax::models
