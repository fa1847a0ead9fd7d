// Launchers of the fused LayerNorm CUDA kernels (layer_norm_cuda.cu). Plain pointers and a
// cudaStream_t only, so nvcc compiles the kernels without LibTorch's headers;
// kernels/layer_norm.cpp checks shapes, dtypes and alignment and is the only caller.
#pragma once

#include "kernels/cuda_common.h"

#include <cstdint>

namespace parallax::kernels::cuda {

// The widest row the kernels take (one warp per row, up to 4 x 8 elements per lane), and the
// row-length granule (one 16-byte vector of 16-bit elements).
constexpr int kMaxCols = 1024;
constexpr int kColGranule = 8;

// y = (s - mean) * rstd * gamma + beta per row of s, where s = x (residual == nullptr) or
// s = x + residual rounded to x's dtype and written to `sum`. mean and rstd ([rows], fp32) are
// saved for the backward. gamma/beta: fp32 [cols].
// Launchers return the launch's cudaError_t as an int (0: success); error_string names it.
int layer_norm_forward(DType t, const void* x, const void* residual, void* sum, void* y,
                       const float* gamma, const float* beta, float* mean, float* rstd,
                       int64_t rows, int cols, float eps, cudaStream_t stream);

// Number of fp32 partial rows layer_norm_backward writes for gamma/beta (size of `partial`:
// 2 x parts x cols floats).
int layer_norm_backward_parts(int64_t rows, int device_sms);

// dx = LayerNorm's input gradient for dy, plus dsum (the gradient that reached `sum` from
// elsewhere; may be nullptr); dgamma/dbeta (fp32 [cols]) through `partial` (fp32
// [2, parts, cols]). s: the normalized input (x, or the saved sum).
int layer_norm_backward(DType t, const void* dy, const void* s, const float* mean,
                        const float* rstd, const float* gamma, const void* dsum, void* dx,
                        float* dgamma, float* dbeta, float* partial, int parts, int64_t rows,
                        int cols, cudaStream_t stream);

}  // namespace parallax::kernels::cuda
