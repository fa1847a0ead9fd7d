#include "models/resnet.h"

#include "core/error.h"
#include "units/param_init.h"

#include <ATen/ATen.h>

#include <cmath>

namespace parallax::models {

namespace {

// A bias-free convolution with torchvision's initialisation: kaiming-normal, mode fan_out,
// gain sqrt(2) (ReLU): std = sqrt(2 / (out * k * k)).
QuantConv2d resnet_conv(int64_t in, int64_t out, int64_t kernel, int64_t stride) {
  QuantConv2d c = units::layer<QuantConv2d>(
      torch::nn::Conv2dOptions(in, out, kernel).stride(stride).padding(kernel / 2).bias(false));
  const double std = std::sqrt(2.0 / static_cast<double>(out * kernel * kernel));
  c->set_initial_weight(units::init_normal({out, in, kernel, kernel}, std));
  return c;
}

}  // namespace

// ---- FrozenBatchNorm2d ------------------------------------------------------------------------

FrozenBatchNorm2dImpl::FrozenBatchNorm2dImpl(int64_t channels, double eps) : eps_(eps) {
  const int64_t c = channels;
  weight = register_parameter("weight", units::init_tensor({c}, [c] { return at::ones({c}); }));
  bias = register_parameter("bias", units::init_zeros({c}));
  running_mean = register_buffer("running_mean", units::init_zeros({c}));
  running_var =
      register_buffer("running_var", units::init_tensor({c}, [c] { return at::ones({c}); }));
  num_batches_tracked = register_buffer(
      "num_batches_tracked", units::init_tensor({}, [] { return at::zeros({}, at::kLong); }));
}

at::Tensor FrozenBatchNorm2dImpl::forward(const at::Tensor& x) {
  // scale and shift in float32 (gradients flow to weight and bias through them), then one
  // multiply-add in x's dtype.
  const at::Tensor scale = weight.to(at::kFloat) * (running_var.to(at::kFloat) + eps_).rsqrt();
  const at::Tensor shift = bias.to(at::kFloat) - running_mean.to(at::kFloat) * scale;
  const at::ScalarType dt = x.scalar_type();
  return at::addcmul(shift.to(dt).view({1, -1, 1, 1}), x, scale.to(dt).view({1, -1, 1, 1}));
}

// ---- Bottleneck -------------------------------------------------------------------------------

Bottleneck::Bottleneck(int64_t in, int64_t width, int64_t stride, int64_t in_h, int64_t in_w)
    : in_(in), width_(width), stride_(stride), in_h_(in_h), in_w_(in_w) {
  const int64_t out = width * kExpansion;
  conv1_ = register_module("conv1", resnet_conv(in, width, 1, 1));
  bn1_ = register_module("bn1", FrozenBatchNorm2d(width));
  conv2_ = register_module("conv2", resnet_conv(width, width, 3, stride));
  bn2_ = register_module("bn2", FrozenBatchNorm2d(width));
  conv3_ = register_module("conv3", resnet_conv(width, out, 1, 1));
  bn3_ = register_module("bn3", FrozenBatchNorm2d(out));
  if (stride != 1 || in != out) {
    ds_conv_ = resnet_conv(in, out, 1, stride);
    ds_bn_ = FrozenBatchNorm2d(out);
    downsample_ = register_module("downsample", torch::nn::Sequential(ds_conv_, ds_bn_));
  }
}

at::Tensor Bottleneck::forward_impl(const at::Tensor& x) {
  at::Tensor y = bn1_->forward(conv1_->forward(x)).relu_();
  y = bn2_->forward(conv2_->forward(y)).relu_();
  y = bn3_->forward(conv3_->forward(y));
  const at::Tensor skip = has_downsample() ? ds_bn_->forward(ds_conv_->forward(x)) : x;
  if (quantized()) {
    // The conv branch, then the skip: the order of the exported graph's two Q/DQ pairs.
    const at::Tensor qy = add_quantizer->forward(y);
    const at::Tensor qx = add_quantizer->forward(skip);
    return (qy + qx).relu_();
  }
  // In place: the multiply-add's backward does not read its output.
  return y.add_(skip).relu_();
}

void Bottleneck::add_quantizers(bool learn_scales) {
  PARALLAX_CHECK(!quantized(), Error, "Bottleneck: quantizers added twice");
  add_quantizer = register_module("add_quantizer", TensorQuantizer(0, learn_scales));
}

Cost Bottleneck::analytic_cost(int64_t in, int64_t width, int64_t stride, int64_t in_h,
                               int64_t in_w) {
  const int64_t out = width * kExpansion, oh = in_h / stride, ow = in_w / stride;
  Cost c = conv_cost(in, width, 1, false, in_h, in_w) + Cost{2 * width, 0.0};
  c += conv_cost(width, width, 3, false, oh, ow) + Cost{2 * width, 0.0};
  c += conv_cost(width, out, 1, false, oh, ow) + Cost{2 * out, 0.0};
  if (stride != 1 || in != out) c += conv_cost(in, out, 1, false, oh, ow) + Cost{2 * out, 0.0};
  return c;
}

// ---- ResNet -----------------------------------------------------------------------------------

std::vector<int64_t> resnet_layers(int64_t depth) {
  if (depth == 50) return {3, 4, 6, 3};
  if (depth == 101) return {3, 4, 23, 3};
  throw_error<ConfigError>("key 'model.backbone': ResNet depths are 50 and 101, got {}", depth);
}

ResNetImpl::ResNetImpl(int64_t depth, int64_t image_h, int64_t image_w) : depth_(depth) {
  const std::vector<int64_t> layers = resnet_layers(depth);
  conv1_ = register_module("conv1", resnet_conv(3, 64, 7, 2));
  bn1_ = register_module("bn1", FrozenBatchNorm2d(64));
  int64_t in = 64, h = image_h / 4, w = image_w / 4;
  for (int64_t s = 1; s <= 4; ++s) {
    const int64_t width = int64_t{64} << (s - 1), stride = s == 1 ? 1 : 2;
    auto list = register_module("layer" + std::to_string(s), torch::nn::ModuleList());
    std::vector<std::shared_ptr<Bottleneck>> stage;
    for (int64_t b = 0; b < layers[static_cast<std::size_t>(s - 1)]; ++b) {
      auto block = std::make_shared<Bottleneck>(in, width, b == 0 ? stride : 1, h, w);
      list->push_back(block);
      stage.push_back(block);
      if (b == 0) {
        h /= stride;
        w /= stride;
      }
      in = width * Bottleneck::kExpansion;
    }
    stages_.push_back(std::move(stage));
  }
}

at::Tensor ResNetImpl::stem(const at::Tensor& images) {
  const at::Tensor y = bn1_->forward(conv1_->forward(images)).relu_();
  return at::max_pool2d(y, {3, 3}, {2, 2}, {1, 1});
}

at::Tensor ResNetImpl::layer(int64_t s, const at::Tensor& x) {
  PARALLAX_CHECK(s >= 1 && s <= 4, Error, "ResNet: no stage {} (1..4)", s);
  at::Tensor y = x;
  for (const auto& b : stages_[static_cast<std::size_t>(s - 1)]) y = b->forward(y);
  return y;
}

std::vector<std::shared_ptr<Block>> ResNetImpl::blocks() const {
  std::vector<std::shared_ptr<Block>> out;
  for (const auto& stage : stages_) out.insert(out.end(), stage.begin(), stage.end());
  return out;
}

Cost ResNetImpl::stage_cost(int64_t depth, int64_t s, int64_t image_h, int64_t image_w) {
  const std::vector<int64_t> layers = resnet_layers(depth);
  if (s == 0) return conv_cost(3, 64, 7, false, image_h / 2, image_w / 2) + Cost{2 * 64, 0.0};
  PARALLAX_CHECK(s >= 1 && s <= 4, Error, "ResNet: no stage {} (0..4)", s);
  // Stage s reads stride 2^(s+1) maps (stage 1 the stem's stride 4) of channels(s - 1) (64 for
  // s = 1) and makes channels(s) at stride 2^(s+1) (stage 1) or 2^(s+2).
  const int64_t width = int64_t{64} << (s - 1), stride = s == 1 ? 1 : 2;
  const int64_t div = int64_t{1} << (s == 1 ? 2 : s);  // the input's stride
  int64_t in = s == 1 ? 64 : channels(s - 1), h = image_h / div, w = image_w / div;
  Cost c;
  for (int64_t b = 0; b < layers[static_cast<std::size_t>(s - 1)]; ++b) {
    c += Bottleneck::analytic_cost(in, width, b == 0 ? stride : 1, h, w);
    if (b == 0) {
      h /= stride;
      w /= stride;
    }
    in = width * Bottleneck::kExpansion;
  }
  return c;
}

Cost ResNetImpl::analytic_cost(int64_t depth, int64_t image_h, int64_t image_w) {
  Cost c;
  for (int64_t s = 0; s <= 4; ++s) c += stage_cost(depth, s, image_h, image_w);
  return c;
}

// ---- FPN --------------------------------------------------------------------------------------

ResNetFpnImpl::ResNetFpnImpl(int64_t c4, int64_t c5, int64_t out) {
  lateral4_ = units::layer<QuantConv2d>(torch::nn::Conv2dOptions(c4, out, 1));
  lateral5_ = units::layer<QuantConv2d>(torch::nn::Conv2dOptions(c5, out, 1));
  out_conv_ = units::layer<QuantConv2d>(torch::nn::Conv2dOptions(out, out, 3).padding(1));
  lateral_ = register_module("lateral_convs", torch::nn::ModuleList(lateral4_, lateral5_));
  output_ = register_module("fpn_convs", torch::nn::ModuleList(out_conv_));
}

at::Tensor ResNetFpnImpl::forward(const at::Tensor& c4, const at::Tensor& c5) {
  const at::Tensor p5 = lateral5_->forward(c5);
  const at::Tensor p4 =
      lateral4_->forward(c4) + at::upsample_nearest2d(p5, {c4.size(2), c4.size(3)});
  return out_conv_->forward(p4);
}

Cost ResNetFpnImpl::analytic_cost(int64_t c4, int64_t c5, int64_t out, int64_t h, int64_t w) {
  return conv_cost(c4, out, 1, true, h, w) + conv_cost(c5, out, 1, true, h / 2, w / 2) +
         conv_cost(out, out, 3, true, h, w);
}

}  // namespace parallax::models
