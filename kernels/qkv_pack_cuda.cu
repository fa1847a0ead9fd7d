// Packs the attention's dq, dk, dv ([B, H, T, hd] each, as SDPA's backward returns them) into the
// qkv projection's gradient [B, T, 3, H, hd] in one pass of 16-byte loads and stores. ATen's
// strided copy of the same bytes runs its generic (non-vectorized) elementwise kernel.
#include "kernels/qkv_pack_cuda.h"

#include <cuda_runtime.h>

namespace parallax::kernels::cuda {

namespace {

__global__ void pack_kernel(const uint4* __restrict__ q, const uint4* __restrict__ k,
                            const uint4* __restrict__ v, uint4* __restrict__ out, int64_t total,
                            int64_t heads, int64_t tokens, int64_t vecs, int64_t s_b, int64_t s_h,
                            int64_t s_t) {
  // One thread per 16-byte vector of the output; strides are in vectors.
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t r = i;
    const int64_t d = r % vecs;
    r /= vecs;
    const int64_t h = r % heads;
    r /= heads;
    const int64_t which = r % 3;
    r /= 3;
    const int64_t t = r % tokens;
    const int64_t b = r / tokens;
    const uint4* src = which == 0 ? q : which == 1 ? k : v;
    out[i] = src[b * s_b + h * s_h + t * s_t + d];
  }
}

}  // namespace

int pack_qkv_grad(const void* dq, const void* dk, const void* dv, void* out, int elem_bytes,
                  int64_t batch, int64_t heads, int64_t tokens, int64_t head_dim,
                  const int64_t strides[3], cudaStream_t stream) {
  if (elem_bytes != 2 || head_dim % 8 != 0) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t vecs = head_dim / 8;
  const int64_t total = batch * tokens * 3 * heads * vecs;
  if (total == 0) return 0;
  const int threads = 256;
  const int64_t want = (total + threads - 1) / threads;
  const int blocks = static_cast<int>(want < (int64_t{1} << 20) ? want : (int64_t{1} << 20));
  pack_kernel<<<blocks, threads, 0, stream>>>(
      static_cast<const uint4*>(dq), static_cast<const uint4*>(dk), static_cast<const uint4*>(dv),
      static_cast<uint4*>(out), total, heads, tokens, vecs, strides[0] / 8, strides[1] / 8,
      strides[2] / 8);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace parallax::kernels::cuda
