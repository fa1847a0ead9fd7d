#include "kernels/layer_norm.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <array>

#ifdef PARALLAX_WITH_CUDA_KERNELS
#include "kernels/launch.h"
#include "kernels/layer_norm_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace parallax::kernels {

namespace {

// The ATen composition, in x's dtype (autocast would run layer_norm in fp32 and return fp32).
std::pair<at::Tensor, at::Tensor> reference(const at::Tensor& x, const at::Tensor& residual,
                                            const at::Tensor& weight, const at::Tensor& bias,
                                            double eps) {
  const at::Tensor s = residual.defined() ? x + residual : x;
  const at::Tensor w = weight.defined() ? weight.to(s.scalar_type()) : at::Tensor();
  const at::Tensor b = bias.defined() ? bias.to(s.scalar_type()) : at::Tensor();
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  at::Tensor y = at::layer_norm(s, {s.size(-1)}, w, b, eps);
  return {y, residual.defined() ? s : at::Tensor()};
}

#ifdef PARALLAX_WITH_CUDA_KERNELS

// The device's SM count (ATen caches the device properties; the backward asks on every call).
int multiprocessors(int device) {
  return at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device))->multiProcessorCount;
}

void check_launch(int rc, const char* what) {
  detail::check_launch(rc, "fused LayerNorm", what);
}

// Shared by the two autograd functions below (LibTorch's custom functions take no undefined
// tensor inputs, so "no residual" is its own function). Returns {y} or {y, sum}.
torch::autograd::variable_list forward_impl(torch::autograd::AutogradContext* ctx,
                                            const at::Tensor& x, const at::Tensor& residual,
                                            const at::Tensor& weight, const at::Tensor& bias,
                                            double eps) {
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  const at::Tensor xc = x.contiguous();
  const at::Tensor rc = residual.defined() ? residual.contiguous() : at::Tensor();
  at::Tensor g = weight.to(at::kFloat).contiguous(), b = bias.to(at::kFloat).contiguous();
  // The kernels read gamma and beta 8 floats at a time: a parameter at an odd offset of a flat
  // buffer (ZeRO) is read from an aligned copy (cols floats).
  if (!detail::aligned16(g)) g = g.clone();
  if (!detail::aligned16(b)) b = b.clone();
  at::Tensor y = at::empty_like(xc, at::MemoryFormat::Contiguous);
  at::Tensor sum = rc.defined() ? at::empty_like(xc, at::MemoryFormat::Contiguous) : at::Tensor();
  const auto stat = x.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({rows}, stat), rstd = at::empty({rows}, stat);
  check_launch(cuda::layer_norm_forward(
                   detail::dtype_of(xc), xc.data_ptr(), rc.defined() ? rc.data_ptr() : nullptr,
                   sum.defined() ? sum.data_ptr() : nullptr, y.data_ptr(), g.data_ptr<float>(),
                   b.data_ptr<float>(), mean.data_ptr<float>(), rstd.data_ptr<float>(), rows,
                   static_cast<int>(cols), static_cast<float>(eps),
                   c10::cuda::getCurrentCUDAStream().stream()),
               "forward");
  ctx->save_for_backward({sum.defined() ? sum : xc, mean, rstd, g});
  ctx->saved_data["weight_dtype"] = weight.scalar_type();
  ctx->saved_data["bias_dtype"] = bias.scalar_type();
  if (sum.defined()) return {y, sum};
  return {y};
}

// {dx (including the sum's own gradient, grads[1], when there is one), dweight, dbias}.
std::array<at::Tensor, 3> backward_impl(torch::autograd::AutogradContext* ctx,
                                        const torch::autograd::variable_list& grads) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor &s = saved[0], &mean = saved[1], &rstd = saved[2], &g = saved[3];
  c10::cuda::CUDAGuard guard(s.device());
  const int64_t cols = s.size(-1), rows = s.numel() / cols;
  at::Tensor dy = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(s);
  at::Tensor dsum = grads.size() > 1 && grads[1].defined() ? grads[1].contiguous() : at::Tensor();
  if (dy.scalar_type() != s.scalar_type()) dy = dy.to(s.scalar_type());
  if (dsum.defined() && dsum.scalar_type() != s.scalar_type()) dsum = dsum.to(s.scalar_type());
  at::Tensor dx = at::empty_like(s, at::MemoryFormat::Contiguous);
  const int parts = cuda::layer_norm_backward_parts(rows, multiprocessors(s.device().index()));
  const auto f32 = s.options().dtype(at::kFloat);
  at::Tensor partial = at::empty({2, parts, cols}, f32);
  at::Tensor dgamma = at::empty({cols}, f32), dbeta = at::empty({cols}, f32);
  check_launch(cuda::layer_norm_backward(
                   detail::dtype_of(s), dy.data_ptr(), s.data_ptr(), mean.data_ptr<float>(),
                   rstd.data_ptr<float>(), g.data_ptr<float>(),
                   dsum.defined() ? dsum.data_ptr() : nullptr, dx.data_ptr(),
                   dgamma.data_ptr<float>(), dbeta.data_ptr<float>(), partial.data_ptr<float>(),
                   parts, rows, static_cast<int>(cols), c10::cuda::getCurrentCUDAStream().stream()),
               "backward");
  return {dx, dgamma.to(ctx->saved_data["weight_dtype"].toScalarType()),
          dbeta.to(ctx->saved_data["bias_dtype"].toScalarType())};
}

struct FusedLayerNorm : public torch::autograd::Function<FusedLayerNorm> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& weight,
                                                const at::Tensor& bias, double eps) {
    return forward_impl(ctx, x, at::Tensor(), weight, bias, eps);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto [dx, dw, db] = backward_impl(ctx, grads);
    return {dx, dw, db, at::Tensor()};
  }
};

// Outputs {y, sum}; the sum's incoming gradient is added to dx inside the backward kernel.
struct FusedAddLayerNorm : public torch::autograd::Function<FusedAddLayerNorm> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, const at::Tensor& bias,
                                                double eps) {
    return forward_impl(ctx, x, residual, weight, bias, eps);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto [dx, dw, db] = backward_impl(ctx, grads);
    return {dx, dx, dw, db, at::Tensor()};
  }
};

#endif  // PARALLAX_WITH_CUDA_KERNELS

}  // namespace

bool fused_layer_norm_supported(const at::Tensor& x, const at::Tensor& residual,
                                const at::Tensor& weight, const at::Tensor& bias) {
#ifdef PARALLAX_WITH_CUDA_KERNELS
  if (!x.defined() || !x.is_cuda() || x.dim() < 1 || x.numel() == 0) return false;
  const auto t = x.scalar_type();
  if (t != at::kFloat && t != at::kBFloat16 && t != at::kHalf) return false;
  const int64_t cols = x.size(-1);
  if (cols % cuda::kColGranule != 0 || cols > cuda::kMaxCols) return false;
  if (!weight.defined() || !bias.defined() || weight.numel() != cols || bias.numel() != cols)
    return false;
  if (weight.device() != x.device() || bias.device() != x.device()) return false;
  if (!x.is_contiguous() || !detail::aligned16(x)) return false;
  if (residual.defined()) {
    if (residual.scalar_type() != t || residual.sizes() != x.sizes() ||
        residual.device() != x.device())
      return false;
    if (!residual.is_contiguous() || !detail::aligned16(residual)) return false;
  }
  return true;
#else
  (void)x;
  (void)residual;
  (void)weight;
  (void)bias;
  return false;
#endif
}

std::pair<at::Tensor, at::Tensor> add_layer_norm(const at::Tensor& x, const at::Tensor& residual,
                                                 const at::Tensor& weight, const at::Tensor& bias,
                                                 double eps, bool fused) {
#ifdef PARALLAX_WITH_CUDA_KERNELS
  if (fused && fused_layer_norm_supported(x, residual, weight, bias)) {
    if (!residual.defined()) return {FusedLayerNorm::apply(x, weight, bias, eps)[0], at::Tensor()};
    auto out = FusedAddLayerNorm::apply(x, residual, weight, bias, eps);
    return {out[0], out[1]};
  }
#endif
  (void)fused;
  return reference(x, residual, weight, bias, eps);
}

}  // namespace parallax::kernels
