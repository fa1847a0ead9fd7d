// Fused BEV sampling: for every BEV reference point, the bilinear samples of all cameras that see
// it, their mean and the seen flag, written straight into the view transformer's lift input; and
// the matching backward. The ATen composition it replaces (kernels/bev_sample.cpp) runs a float32
// grid_sample per camera, a masked sum, a division, a cast and a concatenation, each a pass over a
// [B, C, Z*Q] tensor, and its backward scatters into the feature maps with global atomics.
//
// Forward: one thread per (sample, point). The point's visibility bits over the cameras are read
// once; channels go in chunks of kChunk fp32 accumulators; each visible camera adds its four taps
// (grid_sample's zero padding, align_corners=false, same weights and summation order). Consecutive
// threads hold consecutive BEV cells, so the lifted writes are coalesced, and neighbouring cells
// project to neighbouring feature pixels, so the tap reads mostly hit the same cache lines.
//
// Backward: one block per (sample, camera, 32 channels). That slice of the camera's feature-map
// gradient lives in shared memory (fp32); the warps take groups of 32 points in turn, and
// for each point the camera sees the 32 lanes (one channel each) add weight * grad / count to its
// four taps with shared-memory atomics that never collide within a warp (runs of points on the
// same pixel are summed in registers first). The tile is then written
// once to the gradient: no zero fill, no global atomics. (A first version with one thread per
// point and a channel loop took 35.6 ms per W2 step: neighbouring BEV cells share feature pixels,
// so a warp's atomics serialised on the same addresses.) Feature maps whose 32-channel tile does
// not fit in shared memory (over ~1,600 pixels on Hopper) use global fp32 atomics into a workspace
// and one cast.
#include "kernels/bev_sample_cuda.h"
#include "kernels/device_math.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace parallax::kernels::cuda {

namespace {

constexpr int kChunk = 8;          // fp32 accumulators per thread in the forward
constexpr int kThreads = 256;      // forward and global-backward block size
constexpr int kMaxTileWarps = 16;  // shared-memory backward: warps per block, at most
constexpr int kMinTileWarps = 4;   // and at least (else the global-atomics path)

// The four bilinear taps of a point, as grid_sample computes them: normalised g = u * (2 / W) - 1,
// source index ((g + 1) * Wf - 1) / 2, weights from the floor corners. A tap outside the map has
// valid = false (zero padding).
struct Taps {
  int idx[4];
  float w[4];
  bool valid[4];
};

__device__ __forceinline__ Taps bilinear_taps(float u, float v, float sx, float sy, int fh,
                                              int fw) {
  const float gx = __fsub_rn(__fmul_rn(u, sx), 1.0f);
  const float gy = __fsub_rn(__fmul_rn(v, sy), 1.0f);
  // ATen's source-index line ((g + 1) * size - 1) / 2 compiles to one fused multiply-add.
  const float ix = __fdiv_rn(__fmaf_rn(__fadd_rn(gx, 1.0f), static_cast<float>(fw), -1.0f), 2.0f);
  const float iy = __fdiv_rn(__fmaf_rn(__fadd_rn(gy, 1.0f), static_cast<float>(fh), -1.0f), 2.0f);
  const float x0 = floorf(ix), y0 = floorf(iy);
  const float x1 = x0 + 1.0f, y1 = y0 + 1.0f;
  Taps t;
  // nw, ne, sw, se: grid_sample's order and weight formulas.
  t.w[0] = (x1 - ix) * (y1 - iy);
  t.w[1] = (ix - x0) * (y1 - iy);
  t.w[2] = (x1 - ix) * (iy - y0);
  t.w[3] = (ix - x0) * (iy - y0);
  const float xs[4] = {x0, x1, x0, x1};
  const float ys[4] = {y0, y0, y1, y1};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    t.valid[k] = xs[k] >= 0.0f && xs[k] < static_cast<float>(fw) && ys[k] >= 0.0f &&
                 ys[k] < static_cast<float>(fh);
    t.idx[k] = t.valid[k] ? static_cast<int>(ys[k]) * fw + static_cast<int>(xs[k]) : 0;
  }
  return t;
}

struct Dims {
  int64_t b, n, c, fh, fw, hw, z, q, p, lifted_c;
  float sx, sy;
};

Dims dims_of(const BevSampleShape& s) {
  Dims d;
  d.b = s.batch;
  d.n = s.cameras;
  d.c = s.channels;
  d.fh = s.feat_h;
  d.fw = s.feat_w;
  d.hw = s.feat_h * s.feat_w;
  d.z = s.heights;
  d.q = s.cells;
  d.p = s.heights * s.cells;
  d.lifted_c = s.channels * s.heights + s.heights;
  d.sx = static_cast<float>(2.0 / static_cast<double>(s.image_w));
  d.sy = static_cast<float>(2.0 / static_cast<double>(s.image_h));
  return d;
}

template <typename T>
__global__ void forward_kernel(const T* __restrict__ feat, const float2* __restrict__ uv,
                               const bool* __restrict__ visible, T* __restrict__ lifted,
                               float* __restrict__ count, Dims d) {
  const int64_t total = d.b * d.p;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t b = i / d.p, p = i - b * d.p;
    const int64_t z = p / d.q, q = p - z * d.q;
    unsigned mask = 0;
    for (int64_t n = 0; n < d.n; ++n) {
      if (visible[(b * d.n + n) * d.p + p]) mask |= 1u << n;
    }
    const int seen = __popc(mask);
    count[i] = static_cast<float>(seen);
    T* out = lifted + b * d.lifted_c * d.q + q;  // channel k at out[k * Q]
    out[(d.c * d.z + z) * d.q] = from_f<T>(seen > 0 ? 1.0f : 0.0f);
    const float denom = fmaxf(static_cast<float>(seen), 1.0f);
    for (int64_t c0 = 0; c0 < d.c; c0 += kChunk) {
      float acc[kChunk];
#pragma unroll
      for (int k = 0; k < kChunk; ++k) acc[k] = 0.0f;
      for (unsigned m = mask; m != 0; m &= m - 1) {
        const int n = __ffs(m) - 1;
        const float2 pt = uv[(b * d.n + n) * d.p + p];
        const Taps t =
            bilinear_taps(pt.x, pt.y, d.sx, d.sy, static_cast<int>(d.fh), static_cast<int>(d.fw));
        const T* f = feat + ((b * d.n + n) * d.c + c0) * d.hw;
#pragma unroll
        for (int k = 0; k < kChunk; ++k) {
          if (c0 + k < d.c) {
            const T* fk = f + k * d.hw;
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              if (t.valid[j]) s += to_f(fk[t.idx[j]]) * t.w[j];
            }
            acc[k] += s;
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        if (c0 + k < d.c) out[((c0 + k) * d.z + z) * d.q] = from_f<T>(acc[k] / denom);
      }
    }
  }
}

// One block per (sample, camera, 32-channel tile); the tile of the camera's feature map
// ([32][pitch] fp32, pitch = Hf*Wf rounded up to an odd number so that the 32 channel rows start
// in 32 different banks) lives in shared memory. Each warp takes 32 consecutive points at a time:
// it stages their incoming gradients ([32 channels][32 points], read along the points, so
// coalesced) and their taps, then, for each point the camera sees, every lane adds its own
// channel's weighted gradient to the four taps. The 32 lanes of one atomic hit 32 different rows
// (banks), so a warp never contends with itself, however many points share a feature pixel.
template <typename T>
__global__ void __launch_bounds__(kMaxTileWarps * 32)
    backward_tile_kernel(const T* __restrict__ grad, const float2* __restrict__ uv,
                         const bool* __restrict__ visible, const float* __restrict__ count,
                         T* __restrict__ grad_feat, Dims d, int pitch) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  float* acc = smem;                                            // [32][pitch]
  float* stage = acc + 32 * pitch + warp * (32 * 33 + 32 * 8);  // [32 channels][33]
  int* tap_idx = reinterpret_cast<int*>(stage + 32 * 33);       // [32 points][4], -1: padding
  float* tap_w = stage + 32 * 33 + 32 * 4;                      // [32 points][4]
  const int64_t tiles = (d.c + 31) / 32;
  const int64_t bn = blockIdx.x / tiles, c0 = (blockIdx.x - bn * tiles) * 32;
  const int cc = static_cast<int>(d.c - c0 < 32 ? d.c - c0 : 32);
  const int64_t b = bn / d.n;
  const int hw = static_cast<int>(d.hw);
  for (int j = threadIdx.x; j < 32 * pitch; j += blockDim.x) acc[j] = 0.0f;
  __syncthreads();
  const bool* vis = visible + bn * d.p;
  const float2* pts = uv + bn * d.p;
  // Warps take interleaved groups of 32 points, which spreads a camera's visible region evenly
  // over them (contiguous runs per warp measured 2x slower: a few warps got all the visible cells).
  for (int64_t g0 = static_cast<int64_t>(warp) * 32; g0 < d.p;
       g0 += static_cast<int64_t>(warps) * 32) {
    const int64_t p = g0 + lane;
    const bool seen = p < d.p && vis[p];
    const unsigned mask = __ballot_sync(0xffffffffu, seen);
    if (mask == 0) continue;
    if (seen) {
      const int64_t z = p / d.q, q = p - z * d.q;
      const Taps t = bilinear_taps(pts[p].x, pts[p].y, d.sx, d.sy, static_cast<int>(d.fh),
                                   static_cast<int>(d.fw));
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        tap_idx[lane * 4 + j] = t.valid[j] ? t.idx[j] : -1;
        tap_w[lane * 4 + j] = t.w[j];
      }
      const float denom = fmaxf(count[b * d.p + p], 1.0f);
      const T* g =
          grad + (b * d.lifted_c + c0 * d.z + z) * d.q + q;  // channel c0 + k at g[k * Z * Q]
      // 16 loads in flight before the first use (a dependent loop waits on each in turn).
#pragma unroll
      for (int k0 = 0; k0 < 32; k0 += 16) {
        float r[16];
#pragma unroll
        for (int k = 0; k < 16; ++k) r[k] = k0 + k < cc ? to_f(g[(k0 + k) * d.z * d.q]) : 0.0f;
#pragma unroll
        for (int k = 0; k < 16; ++k) stage[(k0 + k) * 33 + lane] = r[k] / denom;
      }
    }
    __syncwarp();
    if (lane < cc) {
      // Consecutive cells often share a tap pixel: sum runs of equal pixels per tap slot in
      // registers and issue one atomic per run.
      float* a = acc + lane * pitch;
      int run_idx[4] = {-1, -1, -1, -1};
      float run_sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (unsigned m = mask; m != 0; m &= m - 1) {
        const int i = __ffs(m) - 1;
        const float v = stage[lane * 33 + i];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int idx = tap_idx[i * 4 + j];
          const float wv = tap_w[i * 4 + j] * v;
          if (idx == run_idx[j]) {
            run_sum[j] += wv;
          } else {
            if (run_idx[j] >= 0) atomicAdd(a + run_idx[j], run_sum[j]);
            run_idx[j] = idx;
            run_sum[j] = wv;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (run_idx[j] >= 0) atomicAdd(a + run_idx[j], run_sum[j]);
      }
    }
    __syncwarp();
  }
  __syncthreads();
  T* out = grad_feat + (bn * d.c + c0) * d.hw;
  for (int j = threadIdx.x; j < cc * hw; j += blockDim.x) {
    const int k = j / hw;
    out[j] = from_f<T>(acc[k * pitch + (j - k * hw)]);
  }
}

// Feature maps too large for a shared-memory tile: one thread per (sample, camera, point), global
// fp32 atomics into `ws` [B*N, C, Hf, Wf] (zeroed by the launcher).
template <typename T>
__global__ void backward_global_kernel(const T* __restrict__ grad, const float2* __restrict__ uv,
                                       const bool* __restrict__ visible,
                                       const float* __restrict__ count, float* __restrict__ ws,
                                       Dims d) {
  const int64_t total = d.b * d.n * d.p;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (!visible[i]) continue;
    const int64_t bn = i / d.p, p = i - bn * d.p;
    const int64_t b = bn / d.n, z = p / d.q, q = p - z * d.q;
    const Taps t =
        bilinear_taps(uv[i].x, uv[i].y, d.sx, d.sy, static_cast<int>(d.fh), static_cast<int>(d.fw));
    const float denom = fmaxf(count[b * d.p + p], 1.0f);
    const T* g = grad + (b * d.lifted_c + z) * d.q + q;  // channel c at g[c * Z * Q]
    float* a = ws + bn * d.c * d.hw;
    for (int64_t c = 0; c < d.c; ++c) {
      const float gc = to_f(g[c * d.z * d.q]) / denom;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (t.valid[j]) atomicAdd(a + c * d.hw + t.idx[j], t.w[j] * gc);
      }
    }
  }
}

template <typename T>
__global__ void cast_kernel(const float* __restrict__ in, T* __restrict__ out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = from_f<T>(in[i]);
  }
}

int grid_for(int64_t work, int threads) {
  const int64_t want = (work + threads - 1) / threads;
  return static_cast<int>(want < (int64_t{1} << 20) ? (want > 0 ? want : 1) : (int64_t{1} << 20));
}

// The shared-memory backward's launch: warps per block and dynamic shared-memory bytes, or
// warps = 0 when a 32-channel tile of one feature map does not fit the device's per-block limit.
struct TilePlan {
  int warps = 0, pitch = 0, bytes = 0;
};

TilePlan plan_tile(const Dims& d) {
  TilePlan plan;
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    return plan;
  }
  plan.pitch = static_cast<int>(d.hw % 2 == 0 ? d.hw + 1 : d.hw);
  const int64_t tile = int64_t{32} * plan.pitch * static_cast<int64_t>(sizeof(float));
  const int64_t per_warp = (32 * 33 + 32 * 8) * static_cast<int64_t>(sizeof(float));
  for (int warps = kMaxTileWarps; warps >= kMinTileWarps; warps /= 2) {
    if (tile + warps * per_warp <= limit) {
      plan.warps = warps;
      plan.bytes = static_cast<int>(tile + warps * per_warp);
      return plan;
    }
  }
  return plan;
}

template <typename T>
int forward_t(const void* features, const float* uv, const bool* visible, void* lifted,
              float* count, const Dims& d, cudaStream_t stream) {
  forward_kernel<T><<<grid_for(d.b * d.p, kThreads), kThreads, 0, stream>>>(
      static_cast<const T*>(features), reinterpret_cast<const float2*>(uv), visible,
      static_cast<T*>(lifted), count, d);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int backward_t(const void* grad, const float* uv, const bool* visible, const float* count,
               void* grad_feat, float* ws, const Dims& d, cudaStream_t stream) {
  const TilePlan plan = plan_tile(d);
  if (plan.warps > 0) {
    cudaError_t rc = cudaFuncSetAttribute(backward_tile_kernel<T>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, plan.bytes);
    if (rc != cudaSuccess) return static_cast<int>(rc);
    const int64_t blocks = d.b * d.n * ((d.c + 31) / 32);
    backward_tile_kernel<T><<<static_cast<unsigned>(blocks), 32 * plan.warps, plan.bytes, stream>>>(
        static_cast<const T*>(grad), reinterpret_cast<const float2*>(uv), visible, count,
        static_cast<T*>(grad_feat), d, plan.pitch);
    return static_cast<int>(cudaGetLastError());
  }
  if (ws == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t n = d.b * d.n * d.c * d.hw;
  cudaError_t rc = cudaMemsetAsync(ws, 0, static_cast<size_t>(n) * sizeof(float), stream);
  if (rc != cudaSuccess) return static_cast<int>(rc);
  backward_global_kernel<T><<<grid_for(d.b * d.n * d.p, kThreads), kThreads, 0, stream>>>(
      static_cast<const T*>(grad), reinterpret_cast<const float2*>(uv), visible, count, ws, d);
  rc = cudaGetLastError();
  if (rc != cudaSuccess) return static_cast<int>(rc);
  cast_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(ws, static_cast<T*>(grad_feat), n);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int bev_sample_forward(DType t, const void* features, const float* uv, const bool* visible,
                       void* lifted, float* count, const BevSampleShape& s, cudaStream_t stream) {
  if (s.cameras < 1 || s.cameras > 32 || s.heights < 1)
    return static_cast<int>(cudaErrorInvalidValue);
  const Dims d = dims_of(s);
  if (d.b * d.p == 0) return 0;
  switch (t) {
    case DType::kBFloat16:
      return forward_t<__nv_bfloat16>(features, uv, visible, lifted, count, d, stream);
    case DType::kFloat16:
      return forward_t<__half>(features, uv, visible, lifted, count, d, stream);
    default:
      return forward_t<float>(features, uv, visible, lifted, count, d, stream);
  }
}

int64_t bev_sample_backward_workspace(const BevSampleShape& s) {
  const Dims d = dims_of(s);
  return plan_tile(d).warps > 0 || d.c == 0 ? 0 : d.b * d.n * d.c * d.hw;
}

int bev_sample_backward(DType t, const void* grad_lifted, const float* uv, const bool* visible,
                        const float* count, void* grad_features, float* workspace,
                        const BevSampleShape& s, cudaStream_t stream) {
  if (s.cameras < 1 || s.cameras > 32 || s.heights < 1)
    return static_cast<int>(cudaErrorInvalidValue);
  const Dims d = dims_of(s);
  if (d.b * d.n * d.c * d.hw == 0) return 0;
  switch (t) {
    case DType::kBFloat16:
      return backward_t<__nv_bfloat16>(grad_lifted, uv, visible, count, grad_features, workspace, d,
                                       stream);
    case DType::kFloat16:
      return backward_t<__half>(grad_lifted, uv, visible, count, grad_features, workspace, d,
                                stream);
    default:
      return backward_t<float>(grad_lifted, uv, visible, count, grad_features, workspace, d,
                               stream);
  }
}

}  // namespace parallax::kernels::cuda
