// Launchers of the FP8 scaling kernels (fp8_cuda.cu): plain pointers only, like layer_norm_cuda.h.
// kernels/fp8.cpp checks shapes, dtypes and contiguity and is the only caller.
#pragma once

#include "kernels/cuda_common.h"

#include <cstdint>

namespace parallax::kernels::cuda {

// *amax = max |x| over n contiguous elements of dtype t (NaN if any is NaN). Zeroes *amax first.
// Returns the cudaError_t as an int.
int fp8_amax(DType t, const void* x, int64_t n, float* amax, cudaStream_t stream);

// Casts the contiguous [rows, cols] x to FP8 (e5m2 ? E5M2 : E4M3) with
// scale = fmax / max(*amax_for_scale, floor) computed on the device:
//   out   [rows, cols]       saturate(x * scale), round to nearest even (nullptr: not written);
//   out_t [cols, rows_pad]   its transpose, columns rows.. rows_pad-1 zero (nullptr: not written);
//   *inv_scale = 1 / scale;
//   amax_accum (nullable): max-accumulates max |x| (NaN if any is NaN);
//   col_partial (nullable) [ceil(rows / kFp8CastTileRows), cols] fp32: row t holds the column sums
//     of x's rows t * kFp8CastTileRows .. (t + 1) * kFp8CastTileRows - 1, summed in a fixed order
//     (the caller sums the rows: the bias gradient when x is an output gradient).
constexpr int kFp8CastTileRows = 64;
//   gelu: cast gelu(x) (erf form, fp32, rounded to t as fp8_gelu writes it) instead of x: the
//     amax and the column sums are then gelu(x)'s.
int fp8_cast(DType t, const void* x, int64_t rows, int64_t cols, const float* amax_for_scale,
             float fmax, float floor, bool e5m2, void* out, void* out_t, int64_t rows_pad,
             float* inv_scale, float* amax_accum, float* col_partial, bool gelu,
             cudaStream_t stream);

// out[c] = sum over t < tiles of partial[t * cols + c] (fp32), in a fixed order: the bias
// gradient from fp8_cast's col_partial.
int fp8_col_sum(const float* partial, int64_t tiles, int64_t cols, float* out, cudaStream_t stream);

// GELU (erf form, ATen's fp32 arithmetic) over n contiguous elements of dtype t: out = gelu(x)
// when dy is nullptr, else out = dy * gelu'(x) (the backward); amax (nullable): zeroed, then
// max |out| as stored (NaN if any is NaN).
int fp8_gelu(DType t, const void* x, const void* dy, void* out, int64_t n, float* amax,
             cudaStream_t stream);

}  // namespace parallax::kernels::cuda
