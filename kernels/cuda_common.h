// Types shared by the CUDA kernel launchers (kernels/*_cuda.h): plain C++ only, so nvcc compiles
// the .cu files without LibTorch's headers.
#pragma once

typedef struct CUstream_st* cudaStream_t;

namespace parallax::kernels::cuda {

enum class DType { kFloat32, kBFloat16, kFloat16 };

// The name of a cudaError_t returned (as an int) by a launcher; 0 is success.
const char* error_string(int error);

}  // namespace parallax::kernels::cuda
