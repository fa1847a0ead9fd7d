// Launcher of the qkv gradient packing kernel (qkv_pack_cuda.cu); plain pointers only, like
// layer_norm_cuda.h. kernels/qkv_pack.cpp checks the inputs and is the only caller.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace parallax::kernels::cuda {

// dq, dk, dv: [B, H, T, hd] 16-bit tensors with unit innermost stride and the given B/H/T strides
// (elements); out: contiguous [B, T, 3, H, hd]. hd, every stride and every base address must be
// multiples of 8 elements (16 bytes). `elem_bytes` must be 2. Returns the cudaError_t as an int.
int pack_qkv_grad(const void* dq, const void* dk, const void* dv, void* out, int elem_bytes,
                  int64_t batch, int64_t heads, int64_t tokens, int64_t head_dim,
                  const int64_t strides[3], cudaStream_t stream);

}  // namespace parallax::kernels::cuda
