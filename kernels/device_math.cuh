// Internal to the kernels layer (.cu files only): scalar conversions between fp32 and the
// storage types the kernels support (float, bfloat16, half), round to nearest even.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace parallax::kernels::cuda {

__device__ __forceinline__ float to_f(float v) {
  return v;
}
__device__ __forceinline__ float to_f(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
__device__ __forceinline__ float to_f(__half v) {
  return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}

// Rounds an fp32 value to T's precision (what an elementwise op computed in T produces).
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_f(from_f<T>(v));
}

}  // namespace parallax::kernels::cuda
