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

// 8-element vector loads and stores as fp32 (16-byte aligned pointers): fp32 as two float4, the
// 16-bit types as one 16-byte vector of four pairs, converted exactly (to_f of each element).

__device__ __forceinline__ void load8(const float* p, float* f) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x;
  f[1] = a.y;
  f[2] = a.z;
  f[3] = a.w;
  f[4] = b.x;
  f[5] = b.y;
  f[6] = b.z;
  f[7] = b.w;
}
__device__ __forceinline__ void store8(float* p, const float* f) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
// 16-bit types: one 16-byte vector of four pairs, converted through the pair type's intrinsics.
template <typename T>
struct Pair16;
template <>
struct Pair16<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(type h) { return __bfloat1622float2(h); }
  static __device__ __forceinline__ type from_floats(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};
template <>
struct Pair16<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(type h) { return __half22float2(h); }
  static __device__ __forceinline__ type from_floats(float a, float b) {
    return __floats2half2_rn(a, b);
  }
};

template <typename T>
__device__ __forceinline__ void load8(const T* p, float* f) {
  using P = Pair16<T>;
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const typename P::type* h = reinterpret_cast<const typename P::type*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = P::to_float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float* f) {
  using P = Pair16<T>;
  uint4 v;
  typename P::type* h = reinterpret_cast<typename P::type*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = P::from_floats(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = v;
}

}  // namespace parallax::kernels::cuda
