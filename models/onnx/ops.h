// ONNX emitters of the building blocks that several layers share (models/onnx/emitter.h has the
// contracts): linear and conv layers (with the QAT hook points), the norms, GELU, image
// normalisation, and a dispatcher for the torch::nn modules the zoo holds in containers.
//
// Op mapping (opset 17, default domain only):
//   Linear          MatMul(x, Transpose(W)) + b for any rank; Gemm(transB=1) for 2-D inputs
//   Conv2d          Conv (pads, strides; bias input when the layer has one)
//   LayerNorm       LayerNormalization(axis=-1, stash_type=1: statistics in float32)
//   GroupNorm       decomposed: Reshape [N, G, -1], ReduceMean, Sub, Mul, ReduceMean, Add eps,
//   Sqrt,
//                   Div, Reshape back, then the per-channel affine (opset 17 has no
//                   GroupNormalization)
//   GELU (erf)      0.5 * x * (1 + Erf(x / sqrt 2)) (opset 17 has no Gelu)
#pragma once

#include "models/onnx/emitter.h"

#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/normalization.h>

#include <string>

namespace parallax::models::onnx {

// y = x W^T + b with weights `layer`.weight [out, in] and `layer`.bias (when `bias`), for x of any
// rank: MatMul with Transpose(W) (constant-folded by ONNX Runtime and TensorRT), so the
// initializer is exactly the saved tensor.
Value linear(Emitter& e, const Value& x, const std::string& layer, bool bias);
// The same for a 2-D x as one Gemm(transB=1).
Value gemm(Emitter& e, const Value& x, const std::string& layer, bool bias);
// torch::nn::Conv2d registered as `layer` (zero padding, no dilation or groups beyond 1).
Value conv2d(Emitter& e, const Value& x, const std::string& layer,
             const torch::nn::Conv2dImpl& conv);
// torch::nn::GroupNorm `layer` on x [N, C, h, w]; statistics in float32, result in e.dtype().
Value group_norm(Emitter& e, const Value& x, const std::string& layer,
                 const torch::nn::GroupNormImpl& norm, int64_t h, int64_t w);
// torch::nn::LayerNorm `layer` over the last dimension.
Value layer_norm(Emitter& e, const Value& x, const std::string& layer,
                 const torch::nn::LayerNormImpl& norm);
// at::gelu with approximate='none'.
Value gelu(Emitter& e, const Value& x);
// models::normalize_images for uint8 images with channels on `channel_axis` of a rank-`rank`
// tensor: float32 (x * (1 / (255 std_c)) - mean_c / std_c), the same float32 operations, then cast
// to e.dtype().
Value normalize_images(Emitter& e, const Value& images, int64_t channel_axis, int64_t rank);

// A linear layer made by a LinearFactory (models/layers.h): DenseLinear or torch::nn::Linear.
// Other types (e.g. a tensor-parallel shard) have no emitter: Error naming `layer` and the type.
Value linear_module(Emitter& e, const std::string& layer, torch::nn::Module& m, const Value& x);
// A module held in a container (torch::nn::Sequential children): Linear, DenseLinear, GELU, ReLU,
// Sequential (children in order); other types throw Error naming path(`leaf`) and the type.
Value module(Emitter& e, const std::string& leaf, torch::nn::Module& m, const Value& x);

}  // namespace parallax::models::onnx
