// Fused LayerNorm (kernels layer): the transformer's `LayerNorm(x + residual)` as one CUDA kernel
// forward and one backward (plus a tiny column reduction), with its own autograd function.
//
//   auto [y, sum] = add_layer_norm(x, residual, weight, bias, eps);   // sum = x + residual
//   at::Tensor y  = add_layer_norm(x, {}, weight, bias, eps).first;   // plain LayerNorm
//
// Numerics: statistics in fp32; weight/bias used (and their gradients returned) in their own
// dtype, read in fp32 inside the kernel, so fp32 master weights need no per-call cast; the sum
// is rounded to x's dtype exactly as `x + residual` would be. fused_layer_norm_supported() says
// whether the fused kernels take the inputs (CUDA; float32/bfloat16/float16; last dim <= 1024
// and a multiple of 8; residual of x's dtype and shape); otherwise add_layer_norm computes the
// same thing with ATen ops, so callers need no second code path.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace parallax::kernels {

bool fused_layer_norm_supported(const at::Tensor& x, const at::Tensor& residual,
                                const at::Tensor& weight, const at::Tensor& bias);

// Returns {LayerNorm(s), s} with s = x + residual (residual defined) or {LayerNorm(x), undefined}.
// The output has x's dtype. `fused`: false forces the ATen composition.
std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, const at::Tensor& bias,
                                                 double eps, bool fused = true);

}  // namespace parallax::kernels
