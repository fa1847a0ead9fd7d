// Building blocks shared by the model zoo: cost accounting (parameters and forward FLOPs at the
// configured input shape), the `Block` base class that activation recompute wraps, the linear
// factory that tensor parallelism swaps, and the linear and conv/norm layers.
//
// Cost convention: a multiply-add is 2 FLOPs; only matmuls, convolutions and attention
// (QK^T and AV) are counted; norms, activations, softmax, grid sampling and interpolation are
// not. Every module's analytic cost is a static function of its options, so whole models can be
// costed without being constructed (the 3b model); tests check it against real construction.
#pragma once

#include "kernels/fp8.h"
#include "models/onnx/emitter.h"
#include "models/quant.h"
#include "models/recompute.h"
#include "units/linear_spec.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <functional>
#include <string>

namespace parallax::models {

// Parameters and forward FLOPs of one sample at the module's configured input shape.
struct Cost {
  int64_t params = 0;
  double flops = 0;

  Cost& operator+=(const Cost& o) {
    params += o.params;
    flops += o.flops;
    return *this;
  }
  friend Cost operator+(Cost a, const Cost& b) { return a += b; }
  // The same module applied `k` times per sample (shared weights, e.g. across cameras).
  Cost applied(double k) const { return {params, flops * k}; }
  // `k` distinct copies of the module (e.g. a stack of identical blocks).
  Cost copies(int64_t k) const { return {params * k, flops * static_cast<double>(k)}; }
};

// y = x W^T + b over `rows` input rows.
Cost linear_cost(int64_t in, int64_t out, bool bias, double rows);
// Conv2d producing an out_h x out_w map.
Cost conv_cost(int64_t in, int64_t out, int64_t kernel, bool bias, int64_t out_h, int64_t out_w);
// Sum of numel() over a module's parameters (recursively).
int64_t count_parameters(const torch::nn::Module& m);

// The linear layers of attention and MLP blocks are specs built by a factory (units/linear_spec.h):
// dense_linear below, or tensor parallelism's column- and row-parallel layers.
using units::LinearFactory;
using units::LinearRole;
using units::LinearSpec;

// A residual block of the zoo: one tensor in, one tensor out, so that activation recompute
// (models/recompute.h: set_recompute(true) makes forward() recompute forward_impl() in
// backward) and later pipeline stage partitioning can wrap it without knowing its insides.
class Block : public RecomputableBlock {
 public:
  virtual Cost cost() const = 0;
  // forward_impl() as ONNX nodes, inside the block's scope (models/onnx/emitter.h). The default
  // throws parallax::Error naming the block: it has no emitter.
  virtual onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& x);
};

// y = x W^T + b through at::linear, which fuses the bias into the GEMM for inputs of any rank
// (torch::nn::Linear of the C++ frontend runs matmul and a separate broadcast add for 3-D inputs,
// ~15% slower on ViT-B/16). Parameters "weight" [out, in] and "bias" [out] (as torch::nn::Linear),
// initialised N(0, 0.02) and zero (ViT init).
//
// LoRA (train/lora/lora.h, Hu et al. 2021, as PEFT's lora.Linear): add_lora(r, alpha, dropout) adds
// parameters "lora_a" [r, in] (uniform in +-1/sqrt(in), PEFT's kaiming_uniform(a = sqrt(5))) and
// "lora_b" [out, r] (zero, so the output does not change), and the forward becomes
//   y = x W^T + b + (alpha / r) * dropout(x) A^T B^T.
// merge_lora() folds the adapter into W (W += (alpha / r) B A) and removes the two parameters.
//
// QAT (train/qat/qat.h, models/quant.h): add_quantizers() registers "input_quantizer" (per tensor)
// and "weight_quantizer" (per output channel), and the forward becomes
//   y = fq(x) fq(W)^T + b
// (the adapter and the quantizers are not combined: add_quantizers() refuses a layer with an
// adapter and add_lora() one with quantizers).
//
// FP8 (precision.mode=fp8, kernels/fp8.h): enable_fp8() registers the submodule "fp8" and the
// forward runs its three GEMMs in FP8; it refuses a layer with an adapter or quantizers, and they
// refuse it.
class DenseLinearImpl : public torch::nn::Module, public kernels::fp8::Fp8Capable {
 public:
  DenseLinearImpl(int64_t in_features, int64_t out_features, bool bias = true);
  at::Tensor forward(const at::Tensor& x) {
    if (!fp8.is_empty()) return fp8->forward(x, weight, bias);
    if (lora_a.defined()) return lora_forward(x);
    if (!input_quantizer.is_empty()) return quant_forward(x);
    return at::linear(x, weight, bias);
  }

  void add_lora(int64_t rank, double alpha, double dropout);
  bool has_lora() const { return lora_a.defined(); }
  double lora_scale() const { return lora_scale_; }
  // W + scale * B A (the weight the merged model uses); requires an adapter.
  at::Tensor merged_weight() const;
  void merge_lora();

  // Registers the quantizers (disabled; the weight's amax from the current weight).
  // parallax::Error when the layer has an adapter or quantizers already. learn_scales:
  // TensorQuantizerImpl.
  void add_quantizers(bool learn_scales = false);
  bool quantized() const { return !input_quantizer.is_empty(); }

  // parallax::Error when the layer has an adapter, quantizers or FP8 already, or a shape the FP8
  // GEMMs do not take (kernels::fp8::fp8_linear_supported).
  void enable_fp8(const kernels::fp8::Fp8Options& options) override;

  at::Tensor weight, bias;               // bias undefined without one
  kernels::fp8::Fp8Linear fp8{nullptr};  // empty unless FP8
  at::Tensor lora_a, lora_b;             // undefined without an adapter
  TensorQuantizer input_quantizer{nullptr}, weight_quantizer{nullptr};  // empty without QAT

 private:
  at::Tensor lora_forward(const at::Tensor& x);
  at::Tensor quant_forward(const at::Tensor& x);
  double lora_scale_ = 0, lora_dropout_ = 0;
};
TORCH_MODULE(DenseLinear);

// The default factory: a DenseLinear.
torch::nn::AnyModule dense_linear(const LinearSpec& spec);

// Group count for GroupNorm over `channels`: the most groups (up to 32) with >= 4 channels each.
int64_t norm_groups(int64_t channels);

struct ConvNormActOptions {
  int64_t in = 0, out = 0, kernel = 3, stride = 1;
  bool act = true;               // ReLU after the norm
  int64_t out_h = 0, out_w = 0;  // configured output size, for cost()
};

// Conv2d (no bias, padding kernel/2) -> GroupNorm -> ReLU.
class ConvNormActImpl : public torch::nn::Module {
 public:
  explicit ConvNormActImpl(const ConvNormActOptions& o);
  at::Tensor forward(const at::Tensor& x);
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& x);  // models/onnx/layers_onnx.cpp
  Cost cost() const { return analytic_cost(opts_); }
  static Cost analytic_cost(const ConvNormActOptions& o);

 private:
  ConvNormActOptions opts_;
  QuantConv2d conv_{nullptr};
  torch::nn::GroupNorm norm_{nullptr};
};
TORCH_MODULE(ConvNormAct);

// Two 3x3 ConvNormAct at `channels` with an identity skip, ReLU after the sum (ResNet basic block).
//
// QAT (train/qat/qat.h): add_quantizers() registers "add_quantizer", one per-tensor quantizer
// shared by both inputs of the residual Add (the skip x and the conv branch), so the two summands
// sit on one INT8 grid: the Add's inputs then carry Q/DQ pairs with one scale, which TensorRT needs
// to run the Add in INT8 instead of falling back to the higher precision around it (the GroupNorm
// between conv2 and the Add rules out fusing it into the conv). Empty without QAT.
class ResidualConvBlock : public Block {
 public:
  ResidualConvBlock(int64_t channels, int64_t h, int64_t w);
  at::Tensor forward_impl(const at::Tensor& x) override;
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& x) override;
  Cost cost() const override { return analytic_cost(channels_, h_, w_); }
  static Cost analytic_cost(int64_t channels, int64_t h, int64_t w);
  // parallax::Error when it has them already.
  void add_quantizers(bool learn_scales = false);
  bool quantized() const { return !add_quantizer.is_empty(); }

  TensorQuantizer add_quantizer{nullptr};

 private:
  int64_t channels_, h_, w_;
  ConvNormAct conv1_{nullptr}, conv2_{nullptr};
};

}  // namespace parallax::models
