// Test helper: exact fp32 on the GPU (no TF32 in cuBLAS or cuDNN) for the scope's duration, so a
// GPU result can be held to fp32 tolerances against a reference computed another way.
#pragma once

#include <ATen/Context.h>

namespace parallax::testing {

class NoTf32 {
 public:
  NoTf32()
      : cudnn_(at::globalContext().allowTF32CuDNN()),
        cublas_(at::globalContext().allowTF32CuBLAS()) {
    at::globalContext().setAllowTF32CuDNN(false);
    at::globalContext().setAllowTF32CuBLAS(false);
  }
  ~NoTf32() {
    at::globalContext().setAllowTF32CuDNN(cudnn_);
    at::globalContext().setAllowTF32CuBLAS(cublas_);
  }
  NoTf32(const NoTf32&) = delete;
  NoTf32& operator=(const NoTf32&) = delete;

 private:
  bool cudnn_, cublas_;
};

}  // namespace parallax::testing
