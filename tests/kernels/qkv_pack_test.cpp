// kernels::pack_qkv_grad: the packed qkv gradient equals autograd's through view/permute/unbind,
// on the CPU path (every build) and, with a GPU, on the CUDA kernel for each dq/dk/dv layout SDPA
// may return (exact: it only moves bytes). Undefined gradients pack as zeros.
#include "kernels/qkv_pack.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

namespace parallax::kernels {
namespace {

// Autograd's packing of the same gradients (the reference).
at::Tensor reference(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv, int64_t b,
                     int64_t t, int64_t h, int64_t hd) {
  at::Tensor qkv = at::zeros({b, t, 3 * h * hd}, dq.options()).requires_grad_(true);
  auto parts = qkv.view({b, t, 3, h, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
  at::Tensor loss = (parts[0].to(at::kFloat) * dq.to(at::kFloat)).sum() +
                    (parts[1].to(at::kFloat) * dk.to(at::kFloat)).sum() +
                    (parts[2].to(at::kFloat) * dv.to(at::kFloat)).sum();
  loss.backward();
  return qkv.grad();
}

// [B, H, T, hd] gradients in one of the layouts SDPA kernels return.
at::Tensor grad(int layout, int64_t b, int64_t h, int64_t t, int64_t hd,
                const at::TensorOptions& o) {
  if (layout == 0) return at::randn({b, h, t, hd}, o);                        // BHTD contiguous
  if (layout == 1) return at::randn({b, t, h, hd}, o).permute({0, 2, 1, 3});  // BTHD physical
  return at::randn({b, t, 3, h, hd}, o)
      .select(2, 1)
      .permute({0, 2, 1, 3});  // a slice of packed qkv
}

void check(const at::TensorOptions& o, bool expect_fused) {
  const int64_t b = 3, h = 4, t = 13, hd = 16;
  for (int layout = 0; layout < 3; ++layout) {
    const at::Tensor dq = grad(layout, b, h, t, hd, o), dk = grad(layout, b, h, t, hd, o),
                     dv = grad(layout, b, h, t, hd, o);
    EXPECT_EQ(fused_qkv_pack_supported(dq, dk, dv), expect_fused) << "layout " << layout;
    const at::Tensor got = pack_qkv_grad(dq, dk, dv, {b, t, 3 * h * hd});
    EXPECT_TRUE(got.is_contiguous());
    EXPECT_TRUE(at::equal(got, reference(dq, dk, dv, b, t, h, hd))) << "layout " << layout;
  }
  // An undefined gradient (e.g. v unused) packs as zeros, through the strided path.
  const at::Tensor dq = grad(0, b, h, t, hd, o), dk = grad(0, b, h, t, hd, o);
  EXPECT_FALSE(fused_qkv_pack_supported(dq, dk, at::Tensor()));
  const at::Tensor got = pack_qkv_grad(dq, dk, at::Tensor(), {b, t, 3 * h * hd});
  EXPECT_TRUE(at::equal(got, reference(dq, dk, at::zeros_like(dq), b, t, h, hd)));
  EXPECT_THROW(pack_qkv_grad(dq, dk, dq, {b, t, 2 * h * hd}), std::exception);
}

TEST(PackQkvGradTest, CpuMatchesAutograd) {
  check(at::TensorOptions().dtype(at::kFloat), false);
  check(at::TensorOptions().dtype(at::kBFloat16), false);
}

TEST(PackQkvGradTest, CudaKernelMatchesAutogradForEveryLayout) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  check(at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA), true);
  check(at::TensorOptions().dtype(at::kHalf).device(at::kCUDA), true);
  check(at::TensorOptions().dtype(at::kFloat).device(at::kCUDA), false);  // 32-bit: strided copies
}

}  // namespace
}  // namespace parallax::kernels
