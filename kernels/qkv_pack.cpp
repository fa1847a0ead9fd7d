#include "kernels/qkv_pack.h"

#include "core/error.h"

#include <ATen/ATen.h>

#ifdef PARALLAX_WITH_CUDA_KERNELS
#include "kernels/qkv_pack_cuda.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace parallax::kernels {

bool fused_qkv_pack_supported(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
#ifdef PARALLAX_WITH_CUDA_KERNELS
  for (const at::Tensor* t : {&dq, &dk, &dv}) {
    if (!t->defined() || !t->is_cuda() || t->dim() != 4) return false;
    if (t->scalar_type() != at::kBFloat16 && t->scalar_type() != at::kHalf) return false;
    if (t->scalar_type() != dq.scalar_type() || t->sizes() != dq.sizes() ||
        t->strides() != dq.strides())
      return false;
    if (t->device() != dq.device() || t->stride(3) != 1) return false;
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return false;
  }
  if (dq.size(3) % 8 != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (dq.stride(d) % 8 != 0) return false;
  }
  return true;
#else
  (void)dq;
  (void)dk;
  (void)dv;
  return false;
#endif
}

at::Tensor pack_qkv_grad(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                         at::IntArrayRef qkv_shape) {
  const at::Tensor& any = dq.defined() ? dq : dk.defined() ? dk : dv;
  PARALLAX_CHECK(any.defined() && any.dim() == 4 && qkv_shape.size() == 3, Error,
                 "pack_qkv_grad: expected [B, H, T, hd] gradients and a [B, T, 3*H*hd] shape");
  const int64_t b = any.size(0), h = any.size(1), t = any.size(2), hd = any.size(3);
  PARALLAX_CHECK(qkv_shape[0] == b && qkv_shape[1] == t && qkv_shape[2] == 3 * h * hd, Error,
                 "pack_qkv_grad: gradients [{}, {}, {}, {}] do not fit the qkv shape [{}, {}, {}]",
                 b, h, t, hd, qkv_shape[0], qkv_shape[1], qkv_shape[2]);
  at::Tensor g = at::empty(qkv_shape, any.options().memory_format(at::MemoryFormat::Contiguous));
#ifdef PARALLAX_WITH_CUDA_KERNELS
  if (fused_qkv_pack_supported(dq, dk, dv)) {
    c10::cuda::CUDAGuard guard(dq.device());
    const int64_t strides[3] = {dq.stride(0), dq.stride(1), dq.stride(2)};
    const int rc =
        cuda::pack_qkv_grad(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), g.data_ptr(), 2, b, h, t,
                            hd, strides, c10::cuda::getCurrentCUDAStream().stream());
    PARALLAX_CHECK(rc == 0, Error, "pack_qkv_grad: kernel launch failed (cudaError {})", rc);
    return g;
  }
#endif
  const auto slots = g.view({b, t, 3, h, hd}).permute({2, 0, 3, 1, 4});
  const at::Tensor* parts[3] = {&dq, &dk, &dv};
  for (int64_t i = 0; i < 3; ++i) {
    if (parts[i]->defined()) {
      slots[i].copy_(*parts[i]);
    } else {
      slots[i].zero_();
    }
  }
  return g;
}

}  // namespace parallax::kernels
