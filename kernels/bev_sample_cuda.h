// Launchers of the fused BEV sampling kernels (bev_sample_cuda.cu); plain pointers only, like
// layer_norm_cuda.h. kernels/bev_sample.cpp checks the inputs and is the only caller.
#pragma once

#include "kernels/cuda_common.h"

#include <cstdint>

namespace parallax::kernels::cuda {

struct BevSampleShape {
  int64_t batch = 0, cameras = 0, channels = 0;  // B, N (<= 32), C
  int64_t feat_h = 0, feat_w = 0;                // Hf, Wf
  int64_t heights = 0, cells = 0;                // Z, Q; P = Z * Q points per sample
  int64_t image_h = 0, image_w = 0;              // pixels covered by the feature map
};

// features: contiguous [B*N, C, Hf, Wf] of dtype t; uv: float32 [B, N, P, 2]; visible: bool
// [B, N, P]. Writes lifted [B, C*Z + Z, Q] (dtype t) and count (float32 [B, P]).
int bev_sample_forward(DType t, const void* features, const float* uv, const bool* visible,
                       void* lifted, float* count, const BevSampleShape& s, cudaStream_t stream);

// Floats of fp32 workspace bev_sample_backward needs: 0 when a block's shared-memory tile holds
// its channels of one feature map, else B*N*C*Hf*Wf (global atomics, then one cast).
int64_t bev_sample_backward_workspace(const BevSampleShape& s);

// grad_lifted: contiguous [B, C*Z + Z, Q] of dtype t (the seen channels are not read); count from
// the forward. Writes every element of grad_features [B*N, C, Hf, Wf] (dtype t).
int bev_sample_backward(DType t, const void* grad_lifted, const float* uv, const bool* visible,
                        const float* count, void* grad_features, float* workspace,
                        const BevSampleShape& s, cudaStream_t stream);

}  // namespace parallax::kernels::cuda
