#include "models/layers.h"

#include "core/error.h"
#include "units/param_init.h"

#include <ATen/ATen.h>

#include <cmath>

namespace parallax::models {

Cost linear_cost(int64_t in, int64_t out, bool bias, double rows) {
  return {in * out + (bias ? out : 0),
          2.0 * rows * static_cast<double>(in) * static_cast<double>(out)};
}

Cost conv_cost(int64_t in, int64_t out, int64_t kernel, bool bias, int64_t out_h, int64_t out_w) {
  const int64_t weights = in * out * kernel * kernel;
  return {weights + (bias ? out : 0),
          2.0 * static_cast<double>(out_h * out_w) * static_cast<double>(weights)};
}

int64_t count_parameters(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

DenseLinearImpl::DenseLinearImpl(int64_t in_features, int64_t out_features, bool with_bias) {
  weight = register_parameter("weight", units::init_normal({out_features, in_features}, 0.02));
  if (with_bias) bias = register_parameter("bias", units::init_zeros({out_features}));
}

void DenseLinearImpl::enable_fp8(const kernels::fp8::Fp8Options& options) {
  PARALLAX_CHECK(fp8.is_empty(), Error, "FP8: this linear layer is FP8 already");
  PARALLAX_CHECK(!lora_a.defined() && !quantized(), ConfigError,
                 "key 'precision.mode': fp8 does not combine with {} on the same linear layer",
                 lora_a.defined() ? "a LoRA adapter" : "QAT quantizers");
  PARALLAX_CHECK(kernels::fp8::fp8_linear_supported(weight.size(1), weight.size(0)), ConfigError,
                 "key 'precision.mode': fp8 needs linear layers whose in and out features are "
                 "multiples of 16, got a weight [out {}, in {}]",
                 weight.size(0), weight.size(1));
  fp8 = register_module("fp8", kernels::fp8::Fp8Linear(options));
}

void DenseLinearImpl::add_lora(int64_t rank, double alpha, double dropout) {
  PARALLAX_CHECK(fp8.is_empty(), ConfigError,
                 "LoRA: this linear layer computes in FP8 (precision.mode=fp8 and LoRA do not "
                 "combine)");
  PARALLAX_CHECK(!lora_a.defined(), Error, "LoRA: this linear layer already has an adapter");
  PARALLAX_CHECK(!quantized(), Error,
                 "LoRA: this linear layer has QAT quantizers (LoRA and QAT do not combine)");
  PARALLAX_CHECK(rank > 0, ConfigError, "LoRA: rank {} must be positive", rank);
  const int64_t in = weight.size(1), out = weight.size(0);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  // Through units::init_tensor, so that a model built without storage (parallel.meta_init) records
  // the adapters' recipes too (fp32 on the CPU; the engine places them). Built otherwise, they take
  // the weight's dtype and device.
  at::Tensor a = units::init_tensor({rank, in}, [rank, in, bound] {
    return at::empty({rank, in}).uniform_(-bound, bound);
  });
  at::Tensor b = units::init_zeros({out, rank});
  if (units::deferred_init() == nullptr) {
    a = a.to(weight.options());
    b = b.to(weight.options());
  }
  lora_a = register_parameter("lora_a", a);
  lora_b = register_parameter("lora_b", b);
  lora_scale_ = alpha / static_cast<double>(rank);
  lora_dropout_ = dropout;
}

at::Tensor DenseLinearImpl::lora_forward(const at::Tensor& x) {
  if (lora_dropout_ == 0 || !is_training()) {
    // Without dropout on the adapter's input, x W^T + s (x A^T) B^T = x (W + s B A)^T: one GEMM
    // over the activations with the (small, out x in) effective weight, instead of two thin GEMMs
    // and an add that each make a full pass over the activations. The backward's dW_eff GEMM
    // costs what a full fine-tune's dW does. W1 (ViT-B/16, rank 16, 1 x H100): 50.4 ms per step
    // with the two-GEMM form, against 38.1 ms for a full fine-tune (docs/PERFORMANCE.md).
    return at::linear(x, weight + at::mm(lora_b, lora_a) * lora_scale_, bias);
  }
  const at::Tensor h = at::dropout(x, lora_dropout_, true);
  return at::linear(x, weight, bias) + at::linear(at::linear(h, lora_a), lora_b) * lora_scale_;
}

void DenseLinearImpl::add_quantizers(bool learn_scales) {
  PARALLAX_CHECK(fp8.is_empty(), ConfigError,
                 "QAT: this linear layer computes in FP8 (precision.mode=fp8 and QAT do not "
                 "combine)");
  PARALLAX_CHECK(!quantized(), Error, "QAT: this linear layer already has quantizers");
  PARALLAX_CHECK(!lora_a.defined(), Error,
                 "QAT: this linear layer has a LoRA adapter (LoRA and QAT do not combine)");
  input_quantizer = register_module("input_quantizer", TensorQuantizer(0, learn_scales));
  weight_quantizer =
      register_module("weight_quantizer", TensorQuantizer(weight.size(0), learn_scales));
  // A model built without storage has no weight values yet: the transform gives the amax its
  // recipe, the weight's (train/qat/hooks.cpp).
  if (units::deferred_init() != nullptr) return;
  at::NoGradGuard no_grad;
  weight_quantizer->amax.copy_(weight_amax(weight).to(weight_quantizer->amax.device()));
}

at::Tensor DenseLinearImpl::quant_forward(const at::Tensor& x) {
  return at::linear(input_quantizer->forward(x), weight_quantizer->forward(weight), bias);
}

at::Tensor DenseLinearImpl::merged_weight() const {
  PARALLAX_CHECK(lora_a.defined(), Error, "LoRA: merged_weight() on a layer without an adapter");
  at::NoGradGuard no_grad;
  // In fp32 (or wider) whatever the parameters' dtype, rounded once into the weight's dtype.
  const auto acc = at::promote_types(weight.scalar_type(), at::kFloat);
  return (weight.to(acc) + at::mm(lora_b.to(acc), lora_a.to(acc)) * lora_scale_)
      .to(weight.scalar_type());
}

void DenseLinearImpl::merge_lora() {
  const at::Tensor merged = merged_weight();
  {
    at::NoGradGuard no_grad;
    weight.copy_(merged);
  }
  parameters_.erase("lora_a");
  parameters_.erase("lora_b");
  lora_a = lora_b = at::Tensor();
  lora_scale_ = 0;
}

torch::nn::AnyModule dense_linear(const LinearSpec& spec) {
  return torch::nn::AnyModule(DenseLinear(spec.in_features, spec.out_features, spec.bias));
}

int64_t norm_groups(int64_t channels) {
  for (int64_t g : {32, 16, 8, 4, 2}) {
    if (channels % g == 0 && channels / g >= 4) return g;
  }
  return 1;
}

ConvNormActImpl::ConvNormActImpl(const ConvNormActOptions& o) : opts_(o) {
  conv_ = register_module("conv",
                          units::layer<QuantConv2d>(torch::nn::Conv2dOptions(o.in, o.out, o.kernel)
                                                        .stride(o.stride)
                                                        .padding(o.kernel / 2)
                                                        .bias(false)));
  norm_ = register_module("norm", torch::nn::GroupNorm(norm_groups(o.out), o.out));
}

at::Tensor ConvNormActImpl::forward(const at::Tensor& x) {
  at::Tensor y = norm_->forward(conv_->forward(x));
  return opts_.act ? y.relu_() : y;
}

Cost ConvNormActImpl::analytic_cost(const ConvNormActOptions& o) {
  return conv_cost(o.in, o.out, o.kernel, false, o.out_h, o.out_w) + Cost{2 * o.out, 0.0};
}

ResidualConvBlock::ResidualConvBlock(int64_t channels, int64_t h, int64_t w)
    : channels_(channels), h_(h), w_(w) {
  ConvNormActOptions o{channels, channels, 3, 1, true, h, w};
  conv1_ = register_module("conv1", ConvNormAct(o));
  o.act = false;
  conv2_ = register_module("conv2", ConvNormAct(o));
}

at::Tensor ResidualConvBlock::forward_impl(const at::Tensor& x) {
  const at::Tensor y = conv2_->forward(conv1_->forward(x));
  if (quantized()) {
    // The conv branch, then the skip: the order of the exported graph's two Q/DQ pairs
    // (layers_onnx.cpp), which the export's parity reference relies on.
    const at::Tensor qy = add_quantizer->forward(y);
    const at::Tensor qx = add_quantizer->forward(x);
    return (qy + qx).relu_();
  }
  return (y + x).relu_();
}

void ResidualConvBlock::add_quantizers(bool learn_scales) {
  PARALLAX_CHECK(!quantized(), Error, "ResidualConvBlock: quantizers added twice");
  add_quantizer = register_module("add_quantizer", TensorQuantizer(0, learn_scales));
}

Cost ResidualConvBlock::analytic_cost(int64_t channels, int64_t h, int64_t w) {
  return ConvNormActImpl::analytic_cost({channels, channels, 3, 1, true, h, w}).copies(2);
}

}  // namespace parallax::models
