#include "models/backbone.h"
#include "units/param_init.h"

#include "core/error.h"

namespace parallax::models {

namespace {

void check_encoder(const ImageEncoderOptions& o) {
  PARALLAX_CHECK(
      o.backbone == "vit" || o.backbone == "conv" || ImageEncoderImpl::resnet_depth(o.backbone) > 0,
      ConfigError, "key 'model.backbone': expected vit|conv|resnet50|resnet101, got '{}'",
      o.backbone);
  if (ImageEncoderImpl::resnet_depth(o.backbone) > 0) {
    // The FPN adds the 2x upsampled C5 (stride 32) to C4: both maps must be exact.
    PARALLAX_CHECK(o.image_h % 32 == 0 && o.image_w % 32 == 0, ConfigError,
                   "model.backbone '{}' (an FPN on strides 16 and 32) needs an image size "
                   "divisible by 32, got {}x{}",
                   o.backbone, o.image_h, o.image_w);
    return;
  }
  if (o.backbone == "conv") {
    PARALLAX_CHECK(!o.conv.widths.empty() && o.conv.widths.size() == o.conv.blocks.size(),
                   ConfigError, "conv backbone: {} stage widths but {} block counts",
                   o.conv.widths.size(), o.conv.blocks.size());
  }
  const int64_t s = ImageEncoderImpl::stride_of(o);
  // A ViT that pads to whole patches (pad_to_patch) takes any size.
  const bool pads = o.backbone == "vit" && o.vit.pad_to_patch;
  PARALLAX_CHECK(pads || (o.image_h % s == 0 && o.image_w % s == 0), ConfigError,
                 "model.backbone '{}' has stride {}; the image size {}x{} must be divisible by it",
                 o.backbone, s, o.image_h, o.image_w);
}

}  // namespace

int64_t ImageEncoderImpl::resnet_depth(const std::string& backbone) {
  if (backbone == "resnet50") return 50;
  if (backbone == "resnet101") return 101;
  return 0;
}

int64_t ImageEncoderImpl::stride_of(const ImageEncoderOptions& o) {
  if (resnet_depth(o.backbone) > 0) return 16;
  return o.backbone == "vit" ? o.vit.patch : (int64_t{1} << o.conv.widths.size());
}

ImageEncoderImpl::ImageEncoderImpl(const ImageEncoderOptions& o) : opts_(o) {
  check_encoder(o);
  if (o.backbone == "vit") {
    vit_ = register_module("vit", VisionTransformer(VisionTransformerOptions{
                                      o.vit, o.image_h, o.image_w, false, o.linear, o.tp}));
    vit_neck_ = register_module("neck", DenseLinear(o.vit.dim, o.out_channels));
    for (const auto& b : vit_->blocks()) blocks_.push_back(b);
    return;
  }
  if (const int64_t depth = resnet_depth(o.backbone); depth > 0) {
    resnet_ = register_module("resnet", ResNet(depth, o.image_h, o.image_w));
    fpn_ = register_module(
        "fpn", ResNetFpn(ResNetImpl::channels(3), ResNetImpl::channels(4), o.out_channels));
    blocks_ = resnet_->blocks();
    return;
  }
  conv_ = register_module("conv", torch::nn::Sequential());
  int64_t in = 3, h = o.image_h, w = o.image_w;
  for (std::size_t s = 0; s < o.conv.widths.size(); ++s) {
    h /= 2;
    w /= 2;
    conv_->push_back(ConvNormAct(ConvNormActOptions{in, o.conv.widths[s], 3, 2, true, h, w}));
    for (int64_t b = 0; b < o.conv.blocks[s]; ++b) {
      auto blk = std::make_shared<ResidualConvBlock>(o.conv.widths[s], h, w);
      conv_->push_back(blk);
      blocks_.push_back(blk);
    }
    in = o.conv.widths[s];
  }
  conv_neck_ = register_module(
      "neck", units::layer<QuantConv2d>(torch::nn::Conv2dOptions(in, o.out_channels, 1)));
}

at::Tensor ImageEncoderImpl::forward(const at::Tensor& images) {
  if (vit_) return vit_neck(vit_->forward(images));
  if (resnet_) {
    at::Tensor x = images;
    for (int64_t i = 0; i < num_units(); ++i) x = forward_unit(i, x);
    return x;
  }
  return conv_neck_->forward(conv_->forward(images));
}

int64_t ImageEncoderImpl::feat_h() const {
  return vit_ ? vit_->grid_h() : opts_.image_h / stride();
}
int64_t ImageEncoderImpl::feat_w() const {
  return vit_ ? vit_->grid_w() : opts_.image_w / stride();
}

at::Tensor ImageEncoderImpl::vit_neck(const at::Tensor& tokens) {
  // The prefix tokens (class, registers) attended in the blocks; the feature map is the patches'.
  const int64_t prefix = vit_->prefix_tokens();
  const at::Tensor patches =
      prefix > 0 ? tokens.narrow(1, prefix, tokens.size(1) - prefix) : tokens;
  const at::Tensor t = vit_neck_->forward(patches);  // [BN, T, C]
  // [BN, h, w, C] viewed as NCHW: channels-last strides, no copy.
  return t.view({t.size(0), vit_->grid_h(), vit_->grid_w(), t.size(2)}).permute({0, 3, 1, 2});
}

at::Tensor ImageEncoderImpl::forward_unit(int64_t index, const at::Tensor& x) {
  PARALLAX_CHECK(index >= 0 && index < num_units(), Error, "image encoder: unit {} of {}", index,
                 num_units());
  if (resnet_) {
    // Every unit computes in channels-last, the layout the (channels-last) images give the whole
    // trunk: a no-op in one process, and a pipeline stage that receives its input contiguous
    // (NCHW, parallel/pipeline/p2p) runs the same convolution kernels as one process does.
    const at::Tensor in = x.contiguous(at::MemoryFormat::ChannelsLast);
    if (index == 0) return resnet_->layer(1, resnet_->stem(in));
    if (index < 3) return resnet_->layer(index + 1, in);
    return fpn_->forward(in, resnet_->layer(4, in));  // in: C4
  }
  if (!vit_) return forward(x);
  if (index == 0) return vit_->embed(x);
  if (index <= static_cast<int64_t>(blocks_.size())) return blocks_[index - 1]->forward(x);
  return vit_neck(vit_->final_norm(x));
}

std::vector<UnitPaths> ImageEncoderImpl::unit_paths(const std::string& path) const {
  if (resnet_) {
    const std::string r = path + ".resnet";
    return {{r + ".layer1", {r + ".conv1", r + ".bn1", r + ".layer1"}},
            {r + ".layer2", {r + ".layer2"}},
            {r + ".layer3", {r + ".layer3"}},
            {path + ".fpn", {r + ".layer4", path + ".fpn"}}};
  }
  if (!vit_) return {{path, {path}}};
  const std::string vit = path + ".vit";
  std::vector<UnitPaths> specs{
      {vit + ".embed",
       {vit + ".patch_embed", vit + ".cls_token", vit + ".reg_token", vit + ".pos_embed"}}};
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    const std::string block = vit + ".block" + std::to_string(i);
    specs.push_back({block, {block}});
  }
  specs.push_back({path + ".neck", {vit + ".norm", path + ".neck"}});
  return specs;
}

Cost ImageEncoderImpl::analytic_cost(const ImageEncoderOptions& o) {
  check_encoder(o);
  const int64_t s = stride_of(o);
  int64_t fh = o.image_h / s, fw = o.image_w / s;
  if (o.backbone == "vit") {
    fh = VisionTransformerImpl::grid_of(o.image_h, o.vit);
    fw = VisionTransformerImpl::grid_of(o.image_w, o.vit);
    return VisionTransformerImpl::analytic_cost({o.vit, o.image_h, o.image_w, false, o.linear}) +
           linear_cost(o.vit.dim, o.out_channels, true, static_cast<double>(fh * fw));
  }
  if (const int64_t depth = resnet_depth(o.backbone); depth > 0) {
    return ResNetImpl::analytic_cost(depth, o.image_h, o.image_w) +
           ResNetFpnImpl::analytic_cost(ResNetImpl::channels(3), ResNetImpl::channels(4),
                                        o.out_channels, fh, fw);
  }
  Cost c;
  int64_t in = 3, h = o.image_h, w = o.image_w;
  for (std::size_t st = 0; st < o.conv.widths.size(); ++st) {
    h /= 2;
    w /= 2;
    c += ConvNormActImpl::analytic_cost({in, o.conv.widths[st], 3, 2, true, h, w});
    c += ResidualConvBlock::analytic_cost(o.conv.widths[st], h, w).copies(o.conv.blocks[st]);
    in = o.conv.widths[st];
  }
  return c + conv_cost(in, o.out_channels, 1, true, fh, fw);
}

std::vector<double> ImageEncoderImpl::unit_flops(const ImageEncoderOptions& o) {
  const int64_t depth = resnet_depth(o.backbone);
  if (depth == 0) return {};
  check_encoder(o);
  const auto stage = [&](int64_t s) {
    return ResNetImpl::stage_cost(depth, s, o.image_h, o.image_w).flops;
  };
  const Cost fpn = ResNetFpnImpl::analytic_cost(ResNetImpl::channels(3), ResNetImpl::channels(4),
                                                o.out_channels, o.image_h / 16, o.image_w / 16);
  return {stage(0) + stage(1), stage(2), stage(3), stage(4) + fpn.flops};
}

}  // namespace parallax::models
