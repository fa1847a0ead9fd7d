// FP8 scaling kernels: the amax reduction of the current recipe, and one cast kernel that writes
// the row-major FP8 copy and its transpose (the weight gradient's operand layout) from one read
// of the input, computing the scale from the amax on the device and, for the delayed recipe,
// recording this step's amax as it goes. The arithmetic is ATen's: scale = fmax / max(amax, floor)
// (IEEE fp32 division), x * scale in fp32, clamp to +-fmax (NaN passes through), round to nearest
// even, so kernels/fp8.cpp's ATen composition gives the same bits.
#include "kernels/device_math.cuh"
#include "kernels/fp8_cuda.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace parallax::kernels::cuda {

namespace {

constexpr int kTile = 64;      // a 64 x 64 tile per block
constexpr int kThreads = 256;  // 64 columns x 4 row lanes
constexpr int kRowLanes = kThreads / kTile;

// max that keeps NaN: a NaN seen once stays (|x| has a zero sign bit, so as an int it also wins
// atomicMax over every finite value).
__device__ __forceinline__ float nan_max(float m, float a) {
  return (a > m || a != a) ? a : m;
}

__device__ __forceinline__ float warp_nan_max(float m) {
  for (int o = 16; o > 0; o >>= 1) m = nan_max(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// Block-wide nan_max, then one atomicMax of the result's bits into *out (non-negative floats order
// as their bit patterns).
__device__ void block_max_to(float m, float* out) {
  __shared__ float part[32];
  m = warp_nan_max(m);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) part[warp] = m;
  __syncthreads();
  if (warp == 0) {
    m = lane < static_cast<int>(blockDim.x >> 5) ? part[lane] : 0.f;
    m = warp_nan_max(m);
    if (lane == 0) atomicMax(reinterpret_cast<int*>(out), __float_as_int(m));
  }
}

template <typename T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t n, float* amax) {
  float m = 0.f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    m = nan_max(m, fabsf(to_f(x[i])));
  block_max_to(m, amax);
}

// 16-byte loads: 8 elements of a 16-bit type, 4 of fp32.
template <typename T>
__global__ void amax_vec_kernel(const T* __restrict__ x, int64_t n, float* amax) {
  constexpr int kVec = 16 / sizeof(T);
  const int64_t nvec = n / kVec;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float m = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nvec;
       i += stride) {
    const uint4 u = __ldg(xv + i);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = nan_max(m, fabsf(to_f(e[j])));
  }
  for (int64_t i = nvec * kVec + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    m = nan_max(m, fabsf(to_f(x[i])));
  block_max_to(m, amax);
}

__device__ __forceinline__ unsigned char to_fp8(float v, bool e5m2) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

template <typename T>
__global__ void cast_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                            const float* __restrict__ amax_for_scale, float fmax, float floor,
                            bool e5m2, unsigned char* __restrict__ out,
                            unsigned char* __restrict__ out_t, int64_t rows_pad,
                            float* __restrict__ inv_scale, float* __restrict__ amax_accum) {
  __shared__ unsigned char tile[kTile][kTile + 4];
  float a = *amax_for_scale;
  a = a < floor ? floor : a;  // clamp_min: NaN stays NaN, as ATen's
  const float scale = fmax / a;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *inv_scale = 1.f / scale;

  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c = c0 + tx;
  float m = 0.f;
  for (int i = ty; i < kTile; i += kRowLanes) {
    const int64_t r = r0 + i;
    float v = 0.f;
    if (r < rows && c < cols) {
      v = to_f(x[r * cols + c]);
      m = nan_max(m, fabsf(v));
    }
    float s = v * scale;
    s = s > fmax ? fmax : (s < -fmax ? -fmax : s);
    const unsigned char q = to_fp8(s, e5m2);
    if (out != nullptr && r < rows && c < cols) out[r * cols + c] = q;
    tile[i][tx] = (r < rows) ? q : 0;
  }
  if (amax_accum != nullptr) block_max_to(m, amax_accum);
  if (out_t == nullptr) return;
  __syncthreads();
  // out_t[c0 + i][r0 + tx] = tile[tx][i]
  const int64_t rt = r0 + tx;
  for (int i = ty; i < kTile; i += kRowLanes) {
    const int64_t ct = c0 + i;
    if (ct < cols && rt < rows_pad) out_t[ct * rows_pad + rt] = tile[tx][i];
  }
}

// The vectorised cast: 64 x 128 tiles, 256 threads; each thread loads 8 consecutive elements of a
// row (16 or 32 bytes) and stores their 8 FP8 bytes at once, and after the tile is in shared memory
// writes 8 consecutive bytes of a transposed row. Needs cols % 8 == 0, rows_pad % 8 == 0 and
// 16-byte-aligned x (kernels/fp8.cpp's caller checks).
constexpr int kVRows = 64, kVCols = 128, kVStride = kVCols + 8;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    cast_vec_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                    const float* __restrict__ amax_for_scale, float fmax, float floor, bool e5m2,
                    unsigned char* __restrict__ out, unsigned char* __restrict__ out_t,
                    int64_t rows_pad, float* __restrict__ inv_scale,
                    float* __restrict__ amax_accum) {
  __shared__ __align__(16) unsigned char tile[kVRows][kVStride];
  float a = *amax_for_scale;
  a = a < floor ? floor : a;  // clamp_min: NaN stays NaN, as ATen's
  const float scale = fmax / a;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *inv_scale = 1.f / scale;

  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kVRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kVCols;
  const int cg = threadIdx.x % (kVCols / 8), rl = threadIdx.x / (kVCols / 8);  // 16 x 16
  const int64_t c = c0 + cg * 8;
  float m = 0.f;
#pragma unroll
  for (int p = 0; p < kVRows / 16; ++p) {
    const int i = rl + 16 * p;
    const int64_t r = r0 + i;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const bool in = r < rows && c < cols;
    if (in) load8(x + r * cols + c, v);
    unsigned char q[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      m = nan_max(m, fabsf(v[j]));
      float s = v[j] * scale;
      s = s > fmax ? fmax : (s < -fmax ? -fmax : s);
      q[j] = to_fp8(s, e5m2);
    }
    const uint2 packed = *reinterpret_cast<const uint2*>(q);
    if (out != nullptr && in) *reinterpret_cast<uint2*>(out + r * cols + c) = packed;
    *reinterpret_cast<uint2*>(&tile[i][cg * 8]) = packed;
  }
  if (amax_accum != nullptr) block_max_to(m, amax_accum);
  if (out_t == nullptr) return;
  __syncthreads();
  // out_t[c0 + j][r0 + i0 .. i0 + 7] = tile[i0 .. i0 + 7][j]
  const int i0 = (threadIdx.x % 8) * 8;
#pragma unroll
  for (int p = 0; p < kVCols / 32; ++p) {
    const int j = threadIdx.x / 8 + 32 * p;
    const int64_t ct = c0 + j, rt = r0 + i0;
    if (ct >= cols || rt >= rows_pad) continue;
    unsigned char q[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = tile[i0 + k][j];
    *reinterpret_cast<uint2*>(out_t + ct * rows_pad + rt) = *reinterpret_cast<const uint2*>(q);
  }
}

// Enough blocks to fill every SM several times over (132 SMs on an H100/H200), each thread
// reading at least 8 elements; the grid-stride loops cover the rest.
int blocks_for(int64_t n) {
  const int64_t want = (n + kThreads * 8 - 1) / (kThreads * 8);
  return static_cast<int>(want < 1 ? 1 : (want > 4096 ? 4096 : want));
}

template <typename T>
int amax_t(const T* x, int64_t n, float* amax, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(amax, 0, sizeof(float), stream);
  if (e != cudaSuccess) return static_cast<int>(e);
  if (n == 0) return 0;
  const int blocks = blocks_for(n);
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    amax_vec_kernel<<<blocks, kThreads, 0, stream>>>(x, n, amax);
  } else {
    amax_kernel<<<blocks, kThreads, 0, stream>>>(x, n, amax);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int cast_t(const T* x, int64_t rows, int64_t cols, const float* amax_for_scale, float fmax,
           float floor, bool e5m2, unsigned char* out, unsigned char* out_t, int64_t rows_pad,
           float* inv_scale, float* amax_accum, cudaStream_t stream) {
  if (cols % 8 == 0 && rows_pad % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const int64_t vrows = ((out_t != nullptr ? rows_pad : rows) + kVRows - 1) / kVRows;
    const int64_t vcols = (cols + kVCols - 1) / kVCols;
    if (vcols <= 65535) {
      const dim3 grid(static_cast<unsigned>(vrows < 1 ? 1 : vrows), static_cast<unsigned>(vcols));
      cast_vec_kernel<<<grid, kThreads, 0, stream>>>(x, rows, cols, amax_for_scale, fmax, floor,
                                                     e5m2, out, out_t, rows_pad, inv_scale,
                                                     amax_accum);
      return static_cast<int>(cudaGetLastError());
    }
  }
  const int64_t grid_rows = ((out_t != nullptr ? rows_pad : rows) + kTile - 1) / kTile;
  const int64_t grid_cols = (cols + kTile - 1) / kTile;
  // Row tiles on x (2^31 - 1 blocks), column tiles on y (65535: 4 Mi columns).
  if (grid_cols > 65535 || grid_rows > 2147483647) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(grid_rows < 1 ? 1 : grid_rows),
                  static_cast<unsigned>(grid_cols));
  cast_kernel<<<grid, kThreads, 0, stream>>>(x, rows, cols, amax_for_scale, fmax, floor, e5m2, out,
                                             out_t, rows_pad, inv_scale, amax_accum);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int fp8_amax(DType t, const void* x, int64_t n, float* amax, cudaStream_t stream) {
  switch (t) {
    case DType::kBFloat16:
      return amax_t(static_cast<const __nv_bfloat16*>(x), n, amax, stream);
    case DType::kFloat16:
      return amax_t(static_cast<const __half*>(x), n, amax, stream);
    default:
      return amax_t(static_cast<const float*>(x), n, amax, stream);
  }
}

int fp8_cast(DType t, const void* x, int64_t rows, int64_t cols, const float* amax_for_scale,
             float fmax, float floor, bool e5m2, void* out, void* out_t, int64_t rows_pad,
             float* inv_scale, float* amax_accum, cudaStream_t stream) {
  if (rows_pad < rows || cols <= 0) return static_cast<int>(cudaErrorInvalidValue);
  auto* o = static_cast<unsigned char*>(out);
  auto* ot = static_cast<unsigned char*>(out_t);
  switch (t) {
    case DType::kBFloat16:
      return cast_t(static_cast<const __nv_bfloat16*>(x), rows, cols, amax_for_scale, fmax, floor,
                    e5m2, o, ot, rows_pad, inv_scale, amax_accum, stream);
    case DType::kFloat16:
      return cast_t(static_cast<const __half*>(x), rows, cols, amax_for_scale, fmax, floor, e5m2, o,
                    ot, rows_pad, inv_scale, amax_accum, stream);
    default:
      return cast_t(static_cast<const float*>(x), rows, cols, amax_for_scale, fmax, floor, e5m2, o,
                    ot, rows_pad, inv_scale, amax_accum, stream);
  }
}

}  // namespace parallax::kernels::cuda
