// Fused LayerNorm forward/backward for rows of up to 1024 elements (ViT-S/B/L widths): one warp
// per row, the row held in registers, fp32 statistics, fp32 gamma/beta read directly (no
// per-call cast of the master weights), an optional residual add fused into the forward and an
// optional incoming residual gradient fused into the backward. gamma/beta gradients are reduced
// per block in a fixed order (deterministic) and then across blocks by a second small kernel, so
// the rows are read once in the backward instead of twice (ATen's GammaBetaBackward re-reads them).
#include "kernels/device_math.cuh"
#include "kernels/layer_norm_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace parallax::kernels::cuda {

namespace {

constexpr int kWarps = 4;  // warps (rows in flight) per block
constexpr int kThreads = 32 * kWarps;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- kernels ---------------------------------------------------------------------------------

// V: 8-element vectors per lane (cols <= 256 * V).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    ln_forward(const T* __restrict__ x, const T* __restrict__ res, T* __restrict__ sum,
               T* __restrict__ y, const float* __restrict__ gamma, const float* __restrict__ beta,
               float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows, int cols,
               float eps) {
  const int lane = threadIdx.x & 31;
  const int nvec = cols / 8;
  const float inv_n = 1.f / static_cast<float>(cols);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * cols;
    float v[V][8];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int c = lane + 32 * i;
      if (c < nvec) {
        load8(x + base + 8 * c, v[i]);
        if (res != nullptr) {
          float r[8];
          load8(res + base + 8 * c, r);
#pragma unroll
          for (int k = 0; k < 8; ++k) v[i][k] = round_to<T>(v[i][k] + r[k]);
          store8(sum + base + 8 * c, v[i]);
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) s += v[i][k];
      }
    }
    const float mean = warp_sum(s) * inv_n;
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if (lane + 32 * i < nvec) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float d = v[i][k] - mean;
          q += d * d;
        }
      }
    }
    const float rstd = rsqrtf(warp_sum(q) * inv_n + eps);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int c = lane + 32 * i;
      if (c < nvec) {
        float g[8], b[8], o[8];
        load8(gamma + 8 * c, g);
        load8(beta + 8 * c, b);
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = (v[i][k] - mean) * rstd * g[k] + b[k];
        store8(y + base + 8 * c, o);
      }
    }
    if (lane == 0) {
      mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
  }
}

// Input gradient per row plus per-block gamma/beta partial sums (fixed order: deterministic).
template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    ln_backward(const T* __restrict__ dy, const T* __restrict__ s, const float* __restrict__ mean,
                const float* __restrict__ rstd, const float* __restrict__ gamma,
                const T* __restrict__ dsum, T* __restrict__ dx, float* __restrict__ partial,
                int parts, int64_t rows, int cols) {
  __shared__ float red[kWarps][2][kMaxCols];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nvec = cols / 8;
  const float inv_n = 1.f / static_cast<float>(cols);
  float gm[V][8], dg[V][8], db[V][8];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int c = lane + 32 * i;
#pragma unroll
    for (int k = 0; k < 8; ++k) dg[i][k] = db[i][k] = gm[i][k] = 0.f;
    if (c < nvec) load8(gamma + 8 * c, gm[i]);
  }
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t base = row * cols;
    const float mu = mean[row], rs = rstd[row];
    float xh[V][8], g[V][8];
    float a1 = 0.f, a2 = 0.f;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int c = lane + 32 * i;
      if (c < nvec) {
        float d[8];
        load8(dy + base + 8 * c, d);
        load8(s + base + 8 * c, xh[i]);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          xh[i][k] = (xh[i][k] - mu) * rs;
          dg[i][k] += d[k] * xh[i][k];
          db[i][k] += d[k];
          g[i][k] = d[k] * gm[i][k];
          a1 += g[i][k] * xh[i][k];
          a2 += g[i][k];
        }
      }
    }
    const float c1 = warp_sum(a1) * inv_n, c2 = warp_sum(a2) * inv_n;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int c = lane + 32 * i;
      if (c < nvec) {
        float o[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) o[k] = rs * (g[i][k] - xh[i][k] * c1 - c2);
        if (dsum != nullptr) {
          float r[8];
          load8(dsum + base + 8 * c, r);
#pragma unroll
          for (int k = 0; k < 8; ++k) o[k] += r[k];
        }
        store8(dx + base + 8 * c, o);
      }
    }
  }
  // Each warp's column partials into its own shared row, then summed in warp order.
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int c = lane + 32 * i;
    if (c < nvec) {
      store8(&red[warp][0][8 * c], dg[i]);
      store8(&red[warp][1][8 * c], db[i]);
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < cols; j += kThreads) {
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      a += red[w][0][j];
      b += red[w][1][j];
    }
    partial[static_cast<int64_t>(blockIdx.x) * cols + j] = a;
    partial[static_cast<int64_t>(parts + blockIdx.x) * cols + j] = b;
  }
}

// dgamma[j] (blockIdx.y == 0) / dbeta[j] (1) = sum over parts of partial[y][p][j]. A block
// takes 32 columns; its 32 thread rows stride over the parts (coalesced 128-byte reads), then
// combine in shared memory in a fixed order.
constexpr int kReduceRows = 32;
__global__ void __launch_bounds__(32 * kReduceRows)
    ln_reduce_parts(const float* __restrict__ partial, int parts, int cols,
                    float* __restrict__ dgamma, float* __restrict__ dbeta) {
  __shared__ float acc[kReduceRows][33];
  const int j = blockIdx.x * 32 + threadIdx.x;
  const float* p = partial + static_cast<int64_t>(blockIdx.y) * parts * cols + j;
  float a = 0.f;
  if (j < cols) {
    for (int i = threadIdx.y; i < parts; i += kReduceRows) a += p[static_cast<int64_t>(i) * cols];
  }
  acc[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    float t = 0.f;
#pragma unroll
    for (int r = 0; r < kReduceRows; ++r) t += acc[r][threadIdx.x];
    (blockIdx.y == 0 ? dgamma : dbeta)[j] = t;
  }
}

int blocks_for(int64_t rows) {
  const int64_t b = (rows + kWarps - 1) / kWarps;
  return static_cast<int>(b < (int64_t{1} << 20) ? b : (int64_t{1} << 20));
}

template <typename T>
int forward_t(const void* x, const void* residual, void* sum, void* y, const float* gamma,
              const float* beta, float* mean, float* rstd, int64_t rows, int cols, float eps,
              cudaStream_t stream) {
  const int v = (cols + 255) / 256;
  const dim3 grid(blocks_for(rows)), block(kThreads);
  const T* xt = static_cast<const T*>(x);
  const T* rt = static_cast<const T*>(residual);
  T* st = static_cast<T*>(sum);
  T* yt = static_cast<T*>(y);
  switch (v) {
    case 1:
      ln_forward<T, 1>
          <<<grid, block, 0, stream>>>(xt, rt, st, yt, gamma, beta, mean, rstd, rows, cols, eps);
      break;
    case 2:
      ln_forward<T, 2>
          <<<grid, block, 0, stream>>>(xt, rt, st, yt, gamma, beta, mean, rstd, rows, cols, eps);
      break;
    case 3:
      ln_forward<T, 3>
          <<<grid, block, 0, stream>>>(xt, rt, st, yt, gamma, beta, mean, rstd, rows, cols, eps);
      break;
    default:
      ln_forward<T, 4>
          <<<grid, block, 0, stream>>>(xt, rt, st, yt, gamma, beta, mean, rstd, rows, cols, eps);
      break;
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int backward_t(const void* dy, const void* s, const float* mean, const float* rstd,
               const float* gamma, const void* dsum, void* dx, float* dgamma, float* dbeta,
               float* partial, int parts, int64_t rows, int cols, cudaStream_t stream) {
  const int v = (cols + 255) / 256;
  const dim3 grid(parts), block(kThreads);
  const T* dyt = static_cast<const T*>(dy);
  const T* st = static_cast<const T*>(s);
  const T* dst = static_cast<const T*>(dsum);
  T* dxt = static_cast<T*>(dx);
  switch (v) {
    case 1:
      ln_backward<T, 1><<<grid, block, 0, stream>>>(dyt, st, mean, rstd, gamma, dst, dxt, partial,
                                                    parts, rows, cols);
      break;
    case 2:
      ln_backward<T, 2><<<grid, block, 0, stream>>>(dyt, st, mean, rstd, gamma, dst, dxt, partial,
                                                    parts, rows, cols);
      break;
    case 3:
      ln_backward<T, 3><<<grid, block, 0, stream>>>(dyt, st, mean, rstd, gamma, dst, dxt, partial,
                                                    parts, rows, cols);
      break;
    default:
      ln_backward<T, 4><<<grid, block, 0, stream>>>(dyt, st, mean, rstd, gamma, dst, dxt, partial,
                                                    parts, rows, cols);
      break;
  }
  int rc = static_cast<int>(cudaGetLastError());
  if (rc != 0) return rc;
  ln_reduce_parts<<<dim3((cols + 31) / 32, 2), dim3(32, kReduceRows), 0, stream>>>(
      partial, parts, cols, dgamma, dbeta);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int layer_norm_forward(DType t, const void* x, const void* residual, void* sum, void* y,
                       const float* gamma, const float* beta, float* mean, float* rstd,
                       int64_t rows, int cols, float eps, cudaStream_t stream) {
  if (rows == 0) return 0;
  switch (t) {
    case DType::kFloat32:
      return forward_t<float>(x, residual, sum, y, gamma, beta, mean, rstd, rows, cols, eps,
                              stream);
    case DType::kBFloat16:
      return forward_t<__nv_bfloat16>(x, residual, sum, y, gamma, beta, mean, rstd, rows, cols, eps,
                                      stream);
    case DType::kFloat16:
      return forward_t<__half>(x, residual, sum, y, gamma, beta, mean, rstd, rows, cols, eps,
                               stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int layer_norm_backward_parts(int64_t rows, int device_sms) {
  const int64_t want = (rows + kWarps - 1) / kWarps;
  const int64_t cap = static_cast<int64_t>(device_sms > 0 ? device_sms : 1) * 4;
  const int64_t p = want < cap ? want : cap;
  return static_cast<int>(p > 0 ? p : 1);
}

int layer_norm_backward(DType t, const void* dy, const void* s, const float* mean,
                        const float* rstd, const float* gamma, const void* dsum, void* dx,
                        float* dgamma, float* dbeta, float* partial, int parts, int64_t rows,
                        int cols, cudaStream_t stream) {
  switch (t) {
    case DType::kFloat32:
      return backward_t<float>(dy, s, mean, rstd, gamma, dsum, dx, dgamma, dbeta, partial, parts,
                               rows, cols, stream);
    case DType::kBFloat16:
      return backward_t<__nv_bfloat16>(dy, s, mean, rstd, gamma, dsum, dx, dgamma, dbeta, partial,
                                       parts, rows, cols, stream);
    case DType::kFloat16:
      return backward_t<__half>(dy, s, mean, rstd, gamma, dsum, dx, dgamma, dbeta, partial, parts,
                                rows, cols, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

const char* error_string(int error) {
  return cudaGetErrorString(static_cast<cudaError_t>(error));
}

}  // namespace parallax::kernels::cuda
