// Fused BEV sampling (kernels layer): the view transformer's "sample every BEV reference point in
// every camera that sees it and average" as one CUDA kernel forward and one backward, with its own
// autograd function.
//
//   features [B*N, C, Hf, Wf]  camera-major within a sample; the map covers the image exactly
//   uv       float32 [B, N, P, 2]  pixel coordinates of the P = Z * Q reference points
//   (height-major)
//            in an image of image_h x image_w pixels (models/geometry.h: project_points)
//   visible  bool [B, N, P]  (models/geometry.h: visibility_mask)
//
//   auto s = bev_sample(features, uv, visible, Z, image_h, image_w);
//   s.lifted  [B, C*Z + Z, Q] in features' dtype: channel c*Z + z holds, for point (z, q), the mean
//             over the cameras that see it of the bilinear sample of channel c
//             (align_corners=false, zero padding: grid_sample's convention, docs/data.md); 0 where
//             no camera sees it. Channel C*Z + z is 1 where some camera sees the point, else 0.
//             This is the view transformer's lift input (the per-height means and the seen flags)
//             in one tensor.
//   s.count   float32 [B, P]: how many cameras see each point.
//
// Gradients flow to `features` only (the geometry is data). Numerics: samples and the mean in
// fp32, rounded once to features' dtype; the backward accumulates in fp32 (atomics, so the last
// bits of a gradient may differ between runs, as with grid_sample's backward).
//
// fused_bev_sample_supported() says whether the CUDA kernels take the inputs (CUDA tensors on one
// device; float32/bfloat16/float16 contiguous features; contiguous float32 uv, 8-byte aligned; bool
// visible; N <= 32).
// Otherwise, or with fused=false, bev_sample computes the same result with ATen ops (one dense
// grid_sample per camera), the reference the kernels are tested against.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace parallax::kernels {

struct BevSample {
  at::Tensor lifted;  // [B, C*Z + Z, Q], features' dtype
  at::Tensor count;   // float32 [B, P]
};

// The most cameras the fused kernels take (a visibility bit per camera).
inline constexpr int64_t kBevSampleMaxCameras = 32;

bool fused_bev_sample_supported(const at::Tensor& features, const at::Tensor& uv,
                                const at::Tensor& visible);

// Throws parallax::Error naming the mismatch for inconsistent shapes (features.size(0) != B * N,
// P not a multiple of `heights`, ...).
BevSample bev_sample(const at::Tensor& features, const at::Tensor& uv, const at::Tensor& visible,
                     int64_t heights, int64_t image_h, int64_t image_w, bool fused = true);

}  // namespace parallax::kernels
