// The gradient of a packed qkv projection from the attention's dq, dk, dv (kernels layer).
//
//   qkv [B, T, 3*H*hd] --view/permute--> q, k, v [B, H, T, hd] (strided views, no copy)
//   pack_qkv_grad(dq, dk, dv, qkv.sizes()) -> d(qkv) [B, T, 3*H*hd], contiguous
//
// On CUDA (16-bit dtypes, hd a multiple of 8, 16-byte aligned, dq/dk/dv with the same strides)
// one vectorized kernel writes every slot; otherwise strided ATen copies do. An undefined
// gradient packs as zeros.
#pragma once

#include <ATen/core/Tensor.h>

namespace parallax::kernels {

at::Tensor pack_qkv_grad(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                         at::IntArrayRef qkv_shape);

// Whether pack_qkv_grad takes these gradients on its CUDA kernel.
bool fused_qkv_pack_supported(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv);

}  // namespace parallax::kernels
