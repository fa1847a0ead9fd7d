// Internal to the kernels layer: what the .cpp entry points share when they call the CUDA
// launchers (kernels/*_cuda.h). Included only where PARALLAX_WITH_CUDA_KERNELS is defined.
#pragma once

#include "core/error.h"
#include "kernels/cuda_common.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace parallax::kernels::detail {

// The launchers' dtype for a float32/bfloat16/float16 tensor (callers check the dtype first).
inline cuda::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16:
      return cuda::DType::kBFloat16;
    case at::kHalf:
      return cuda::DType::kFloat16;
    default:
      return cuda::DType::kFloat32;
  }
}

// Whether `t`'s data starts on a 16-byte boundary, as the kernels' vector loads need. A tensor can
// be a view at any element offset of a larger buffer: ZeRO packs the parameters, of every size,
// into flat buffers (its shards and gathered parameters; a learned LSQ amax of one element shifts
// every parameter after it), so a kernel checks each pointer it loads vectors from (the FP8
// launchers check theirs in kernels/fp8_cuda.cu).
inline bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// Throws parallax::Error naming the kernel and the CUDA error when a launcher returned non-zero.
inline void check_launch(int rc, const char* kernel, const char* what) {
  PARALLAX_CHECK(rc == 0, Error, "{}: {} kernel launch failed: {}", kernel, what,
                 cuda::error_string(rc));
}

}  // namespace parallax::kernels::detail
