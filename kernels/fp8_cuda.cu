// FP8 scaling kernels: the amax reduction of the current recipe, and one cast kernel that writes
// the row-major FP8 copy and its transpose (the weight gradient's operand layout) from one read
// of the input, computing the scale from the amax on the device and, for the delayed recipe,
// recording this step's amax as it goes; for an output gradient it also sums each 64-row tile's
// columns (the bias gradient, which otherwise costs a second read of the gradient). The arithmetic
// is ATen's: scale = fmax / max(amax, floor) (IEEE fp32 division), x * scale in fp32, clamp to
// +-fmax (NaN passes through), round to nearest even, so kernels/fp8.cpp's ATen composition gives
// the same bits.
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

// GELU (erf form) between two FP8 linear layers, ATen's arithmetic in fp32 (GeluCUDAKernelImpl
// and GeluBackwardCUDAKernelImpl: x * 0.5 * (1 + erf(x / sqrt 2)), and
// dy * (cdf + x * pdf) with pdf = exp(-x^2 / 2) / sqrt(2 pi)), rounded once to the tensor's dtype;
// the amax of what is written (the next cast's scale) comes from the same pass.
__device__ __forceinline__ float gelu_f(float x) {
  constexpr float kAlpha = static_cast<float>(M_SQRT1_2);
  return x * 0.5f * (1.f + erff(x * kAlpha));
}
__device__ __forceinline__ float gelu_grad_f(float dy, float x) {
  constexpr float kAlpha = static_cast<float>(M_SQRT1_2);
  constexpr float kBeta = static_cast<float>(M_2_SQRTPI * M_SQRT1_2 * 0.5);
  const float cdf = 0.5f * (1.f + erff(x * kAlpha));
  const float pdf = expf(-0.5f * x * x) * kBeta;
  return dy * (cdf + x * pdf);
}

__device__ __forceinline__ unsigned char to_fp8(float v, bool e5m2) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

// kGelu: the tensor cast is gelu(x) rounded to T, what the GELU kernel would have written (the
// folded GELU of fc2's input: gelu(x) is never stored).
template <typename T, bool kGelu>
__global__ void cast_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                            const float* __restrict__ amax_for_scale, float fmax, float floor,
                            bool e5m2, unsigned char* __restrict__ out,
                            unsigned char* __restrict__ out_t, int64_t rows_pad,
                            float* __restrict__ inv_scale, float* __restrict__ amax_accum,
                            float* __restrict__ col_partial) {
  __shared__ unsigned char tile[kTile][kTile + 4];
  __shared__ float col_red[kRowLanes][kTile];
  float a = *amax_for_scale;
  a = a < floor ? floor : a;  // clamp_min: NaN stays NaN, as ATen's
  const float scale = fmax / a;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *inv_scale = 1.f / scale;

  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t c = c0 + tx;
  float m = 0.f, col = 0.f;
  for (int i = ty; i < kTile; i += kRowLanes) {
    const int64_t r = r0 + i;
    float v = 0.f;
    if (r < rows && c < cols) {
      v = to_f(x[r * cols + c]);
      if constexpr (kGelu) v = round_to<T>(gelu_f(v));
      m = nan_max(m, fabsf(v));
      col += v;
    }
    float s = v * scale;
    s = s > fmax ? fmax : (s < -fmax ? -fmax : s);
    const unsigned char q = to_fp8(s, e5m2);
    if (out != nullptr && r < rows && c < cols) out[r * cols + c] = q;
    tile[i][tx] = (r < rows) ? q : 0;
  }
  if (col_partial != nullptr) {
    // This tile's column sums: each row lane's, then the lanes' in order (deterministic).
    col_red[ty][tx] = col;
    __syncthreads();
    if (ty == 0 && r0 < rows && c < cols) {
      float sum = 0.f;
      for (int l = 0; l < kRowLanes; ++l) sum += col_red[l][tx];
      col_partial[blockIdx.x * cols + c] = sum;
    }
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

template <typename T, bool kGelu>
__global__ void __launch_bounds__(kThreads)
    cast_vec_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                    const float* __restrict__ amax_for_scale, float fmax, float floor, bool e5m2,
                    unsigned char* __restrict__ out, unsigned char* __restrict__ out_t,
                    int64_t rows_pad, float* __restrict__ inv_scale, float* __restrict__ amax_accum,
                    float* __restrict__ col_partial) {
  __shared__ __align__(16) unsigned char tile[kVRows][kVStride];
  __shared__ float col_red[kVRows / 4][kVCols];
  float a = *amax_for_scale;
  a = a < floor ? floor : a;  // clamp_min: NaN stays NaN, as ATen's
  const float scale = fmax / a;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *inv_scale = 1.f / scale;

  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kVRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kVCols;
  const int cg = threadIdx.x % (kVCols / 8), rl = threadIdx.x / (kVCols / 8);  // 16 x 16
  const int64_t c = c0 + cg * 8;
  float m = 0.f;
  float col[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
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
      if constexpr (kGelu) v[j] = round_to<T>(gelu_f(v[j]));  // gelu(0) = 0 outside the tensor
      m = nan_max(m, fabsf(v[j]));
      col[j] += v[j];
      float s = v[j] * scale;
      s = s > fmax ? fmax : (s < -fmax ? -fmax : s);
      q[j] = to_fp8(s, e5m2);
    }
    const uint2 packed = *reinterpret_cast<const uint2*>(q);
    if (out != nullptr && in) *reinterpret_cast<uint2*>(out + r * cols + c) = packed;
    *reinterpret_cast<uint2*>(&tile[i][cg * 8]) = packed;
  }
  if (col_partial != nullptr) {
    // This tile's column sums: each of the 16 row lanes' (4 rows each), then the lanes' in order
    // (deterministic: no atomics).
#pragma unroll
    for (int j = 0; j < 8; ++j) col_red[rl][cg * 8 + j] = col[j];
    __syncthreads();
    if (threadIdx.x < kVCols && r0 < rows && c0 + threadIdx.x < cols) {
      float sum = 0.f;
#pragma unroll
      for (int l = 0; l < kVRows / 4; ++l) sum += col_red[l][threadIdx.x];
      col_partial[blockIdx.x * cols + c0 + threadIdx.x] = sum;
    }
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

// out[c] = sum over t of partial[t][c], the tiles in order (deterministic): 32 columns per block,
// 8 lanes of tiles each summed in order, then the lanes in order. One pass over the small partial
// buffer (ATen's column reduction of it took ~15 us per call, latency-bound).
constexpr int kSumCols = 32, kSumLanes = kThreads / kSumCols;

__global__ void __launch_bounds__(kThreads)
    col_sum_kernel(const float* __restrict__ partial, int64_t tiles, int64_t cols,
                   float* __restrict__ out) {
  __shared__ float red[kSumLanes][kSumCols];
  const int tx = threadIdx.x % kSumCols, ty = threadIdx.x / kSumCols;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSumCols + tx;
  float s = 0.f;
  if (c < cols) {
    for (int64_t t = ty; t < tiles; t += kSumLanes) s += partial[t * cols + c];
  }
  red[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < cols) {
    float sum = 0.f;
#pragma unroll
    for (int l = 0; l < kSumLanes; ++l) sum += red[l][tx];
    out[c] = sum;
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

template <typename T, bool kGelu>
int cast_t(const T* x, int64_t rows, int64_t cols, const float* amax_for_scale, float fmax,
           float floor, bool e5m2, unsigned char* out, unsigned char* out_t, int64_t rows_pad,
           float* inv_scale, float* amax_accum, float* col_partial, cudaStream_t stream) {
  if (cols % 8 == 0 && rows_pad % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const int64_t vrows = ((out_t != nullptr ? rows_pad : rows) + kVRows - 1) / kVRows;
    const int64_t vcols = (cols + kVCols - 1) / kVCols;
    if (vcols <= 65535) {
      const dim3 grid(static_cast<unsigned>(vrows < 1 ? 1 : vrows), static_cast<unsigned>(vcols));
      cast_vec_kernel<T, kGelu><<<grid, kThreads, 0, stream>>>(x, rows, cols, amax_for_scale, fmax,
                                                               floor, e5m2, out, out_t, rows_pad,
                                                               inv_scale, amax_accum, col_partial);
      return static_cast<int>(cudaGetLastError());
    }
  }
  const int64_t grid_rows = ((out_t != nullptr ? rows_pad : rows) + kTile - 1) / kTile;
  const int64_t grid_cols = (cols + kTile - 1) / kTile;
  // Row tiles on x (2^31 - 1 blocks), column tiles on y (65535: 4 Mi columns).
  if (grid_cols > 65535 || grid_rows > 2147483647) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(grid_rows < 1 ? 1 : grid_rows),
                  static_cast<unsigned>(grid_cols));
  cast_kernel<T, kGelu><<<grid, kThreads, 0, stream>>>(x, rows, cols, amax_for_scale, fmax, floor,
                                                       e5m2, out, out_t, rows_pad, inv_scale,
                                                       amax_accum, col_partial);
  return static_cast<int>(cudaGetLastError());
}

// out = gelu(x) (dy == nullptr) or gelu'(x) * dy; amax (nullable) max-accumulates |out| as
// stored. `vec`: every pointer 16-byte aligned and n % 8 == 0.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    gelu_kernel(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ out, int64_t n,
                float* __restrict__ amax) {
  float m = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if constexpr (kVec) {
    for (int64_t i = first; i < n / 8; i += stride) {
      float v[8], g[8];
      load8(x + 8 * i, v);
      if (dy != nullptr) load8(dy + 8 * i, g);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        v[j] = round_to<T>(dy != nullptr ? gelu_grad_f(g[j], v[j]) : gelu_f(v[j]));
        m = nan_max(m, fabsf(v[j]));
      }
      store8(out + 8 * i, v);
    }
  } else {
    for (int64_t i = first; i < n; i += stride) {
      const float v = to_f(x[i]);
      const T r = from_f<T>(dy != nullptr ? gelu_grad_f(to_f(dy[i]), v) : gelu_f(v));
      out[i] = r;
      m = nan_max(m, fabsf(to_f(r)));
    }
  }
  if (amax != nullptr) block_max_to(m, amax);
}

template <typename T>
int gelu_t(const T* x, const T* dy, T* out, int64_t n, float* amax, cudaStream_t stream) {
  if (amax != nullptr) {
    const cudaError_t e = cudaMemsetAsync(amax, 0, sizeof(float), stream);
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  if (n == 0) return 0;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const int blocks = blocks_for(n);
  if (n % 8 == 0 && aligned(x) && aligned(out) && (dy == nullptr || aligned(dy))) {
    gelu_kernel<T, true><<<blocks, kThreads, 0, stream>>>(x, dy, out, n, amax);
  } else {
    gelu_kernel<T, false><<<blocks, kThreads, 0, stream>>>(x, dy, out, n, amax);
  }
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

namespace {

template <bool kGelu>
int cast_dispatch(DType t, const void* x, int64_t rows, int64_t cols, const float* amax_for_scale,
                  float fmax, float floor, bool e5m2, unsigned char* o, unsigned char* ot,
                  int64_t rows_pad, float* inv_scale, float* amax_accum, float* col_partial,
                  cudaStream_t stream) {
  switch (t) {
    case DType::kBFloat16:
      return cast_t<__nv_bfloat16, kGelu>(static_cast<const __nv_bfloat16*>(x), rows, cols,
                                          amax_for_scale, fmax, floor, e5m2, o, ot, rows_pad,
                                          inv_scale, amax_accum, col_partial, stream);
    case DType::kFloat16:
      return cast_t<__half, kGelu>(static_cast<const __half*>(x), rows, cols, amax_for_scale, fmax,
                                   floor, e5m2, o, ot, rows_pad, inv_scale, amax_accum, col_partial,
                                   stream);
    default:
      return cast_t<float, kGelu>(static_cast<const float*>(x), rows, cols, amax_for_scale, fmax,
                                  floor, e5m2, o, ot, rows_pad, inv_scale, amax_accum, col_partial,
                                  stream);
  }
}

}  // namespace

int fp8_cast(DType t, const void* x, int64_t rows, int64_t cols, const float* amax_for_scale,
             float fmax, float floor, bool e5m2, void* out, void* out_t, int64_t rows_pad,
             float* inv_scale, float* amax_accum, float* col_partial, bool gelu,
             cudaStream_t stream) {
  if (rows_pad < rows || cols <= 0) return static_cast<int>(cudaErrorInvalidValue);
  auto* o = static_cast<unsigned char*>(out);
  auto* ot = static_cast<unsigned char*>(out_t);
  // A kernel instance of its own for the folded GELU, so that the erf costs the other casts
  // nothing (bench/NOTES.md, levers 38 and 39).
  return gelu ? cast_dispatch<true>(t, x, rows, cols, amax_for_scale, fmax, floor, e5m2, o, ot,
                                    rows_pad, inv_scale, amax_accum, col_partial, stream)
              : cast_dispatch<false>(t, x, rows, cols, amax_for_scale, fmax, floor, e5m2, o, ot,
                                     rows_pad, inv_scale, amax_accum, col_partial, stream);
}

int fp8_gelu(DType t, const void* x, const void* dy, void* out, int64_t n, float* amax,
             cudaStream_t stream) {
  switch (t) {
    case DType::kBFloat16:
      return gelu_t(static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(dy),
                    static_cast<__nv_bfloat16*>(out), n, amax, stream);
    case DType::kFloat16:
      return gelu_t(static_cast<const __half*>(x), static_cast<const __half*>(dy),
                    static_cast<__half*>(out), n, amax, stream);
    default:
      return gelu_t(static_cast<const float*>(x), static_cast<const float*>(dy),
                    static_cast<float*>(out), n, amax, stream);
  }
}

int fp8_col_sum(const float* partial, int64_t tiles, int64_t cols, float* out,
                cudaStream_t stream) {
  if (cols <= 0) return 0;
  const int64_t blocks = (cols + kSumCols - 1) / kSumCols;
  if (blocks > 2147483647) return static_cast<int>(cudaErrorInvalidValue);
  col_sum_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(partial, tiles, cols, out);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace parallax::kernels::cuda
