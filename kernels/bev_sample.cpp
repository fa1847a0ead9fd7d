#include "kernels/bev_sample.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <fmt/ranges.h>
#include <torch/autograd.h>

#ifdef PARALLAX_WITH_CUDA_KERNELS
#include "kernels/bev_sample_cuda.h"
#include "kernels/launch.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace parallax::kernels {

namespace {

struct Dims {
  int64_t b, n, c, fh, fw, z, q, p;
};

// The sizes of validated inputs (check_dims).
Dims dims_of(const at::Tensor& features, const at::Tensor& uv, int64_t heights) {
  const int64_t p = uv.size(2);
  return {uv.size(0),       uv.size(1), features.size(1), features.size(2),
          features.size(3), heights,    p / heights,      p};
}

Dims check_dims(const at::Tensor& features, const at::Tensor& uv, const at::Tensor& visible,
                int64_t heights, int64_t image_h, int64_t image_w) {
  PARALLAX_CHECK(features.defined() && uv.defined() && visible.defined(), Error,
                 "bev_sample: features, uv and visible must all be defined");
  PARALLAX_CHECK(uv.dim() == 4 && uv.size(3) == 2, Error,
                 "bev_sample: uv must be [B, N, P, 2], got {}", fmt::format("{}", uv.sizes()));
  const int64_t b = uv.size(0), n = uv.size(1), p = uv.size(2);
  PARALLAX_CHECK(
      visible.dim() == 3 && visible.size(0) == b && visible.size(1) == n && visible.size(2) == p,
      Error, "bev_sample: visible must be [B, N, P] = [{}, {}, {}] like uv, got {}", b, n, p,
      fmt::format("{}", visible.sizes()));
  PARALLAX_CHECK(visible.scalar_type() == at::kBool, Error,
                 "bev_sample: visible must be bool, got {}", c10::toString(visible.scalar_type()));
  PARALLAX_CHECK(features.dim() == 4 && features.size(0) == b * n, Error,
                 "bev_sample: features must be [B*N, C, Hf, Wf] with B*N = {}, got {}", b * n,
                 fmt::format("{}", features.sizes()));
  PARALLAX_CHECK(heights >= 1 && p % heights == 0, Error,
                 "bev_sample: the {} points per sample are not {} heights of equal size", p,
                 heights);
  PARALLAX_CHECK(image_h > 0 && image_w > 0, Error, "bev_sample: image size {}x{} must be positive",
                 image_h, image_w);
  return dims_of(features, uv, heights);
}

// The ATen composition: one dense grid_sample per camera in float32, weighted by visibility.
BevSample reference(const at::Tensor& features, const at::Tensor& uv, const at::Tensor& visible,
                    const Dims& d, int64_t image_h, int64_t image_w) {
  const at::Tensor per_cam = features.to(at::kFloat).view({d.b, d.n, d.c, d.fh, d.fw});
  // Normalised coordinates 2u/W - 1 (align_corners=false); unseen points are parked outside the
  // map so they read nothing, whatever their projection was (behind a camera it may be inf).
  at::Tensor grid = at::stack({uv.select(-1, 0) * (2.0 / static_cast<double>(image_w)) - 1,
                               uv.select(-1, 1) * (2.0 / static_cast<double>(image_h)) - 1},
                              -1);
  grid = at::where(visible.unsqueeze(-1), grid, at::full({}, -2.0, grid.options()));
  at::Tensor acc = at::zeros({d.b, d.c, d.p}, per_cam.options());
  for (int64_t cam = 0; cam < d.n; ++cam) {
    const at::Tensor s =
        at::grid_sampler(per_cam.select(1, cam), grid.select(1, cam).unsqueeze(1), 0, 0, false);
    acc = acc + s.squeeze(2) * visible.select(1, cam).to(at::kFloat).unsqueeze(1);
  }
  const at::Tensor count = visible.to(at::kFloat).sum(1);  // [B, P]
  const at::Tensor mean = (acc / count.clamp_min(1).unsqueeze(1)).to(features.scalar_type());
  const at::Tensor seen = (count > 0).to(features.scalar_type());
  return {at::cat({mean.view({d.b, d.c * d.z, d.q}), seen.view({d.b, d.z, d.q})}, 1), count};
}

#ifdef PARALLAX_WITH_CUDA_KERNELS

void check_launch(int rc, const char* what) {
  detail::check_launch(rc, "fused BEV sampling", what);
}

cuda::BevSampleShape shape_of(const Dims& d, int64_t image_h, int64_t image_w) {
  return {d.b, d.n, d.c, d.fh, d.fw, d.z, d.q, image_h, image_w};
}

struct FusedBevSample : public torch::autograd::Function<FusedBevSample> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& features, const at::Tensor& uv,
                                                const at::Tensor& visible, int64_t heights,
                                                int64_t image_h, int64_t image_w) {
    const Dims d = dims_of(features, uv, heights);  // validated by bev_sample()
    c10::cuda::CUDAGuard guard(features.device());
    at::Tensor lifted = at::empty({d.b, d.c * d.z + d.z, d.q}, features.options());
    at::Tensor count = at::empty({d.b, d.p}, uv.options());
    const cuda::BevSampleShape s = shape_of(d, image_h, image_w);
    check_launch(cuda::bev_sample_forward(detail::dtype_of(features), features.data_ptr(),
                                          uv.data_ptr<float>(), visible.data_ptr<bool>(),
                                          lifted.data_ptr(), count.data_ptr<float>(), s,
                                          c10::cuda::getCurrentCUDAStream().stream()),
                 "forward");
    ctx->save_for_backward({uv, visible, count});
    ctx->saved_data["dims"] = std::vector<int64_t>{d.c, d.fh, d.fw, d.z, image_h, image_w};
    ctx->saved_data["dtype"] = features.scalar_type();
    ctx->mark_non_differentiable({count});
    return {lifted, count};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &uv = saved[0], &visible = saved[1], &count = saved[2];
    const std::vector<int64_t> dims = ctx->saved_data["dims"].toIntVector();
    const at::ScalarType dtype = ctx->saved_data["dtype"].toScalarType();
    const int64_t b = uv.size(0), n = uv.size(1), p = uv.size(2);
    const Dims d{b, n, dims[0], dims[1], dims[2], dims[3], p / dims[3], p};
    const auto opts = uv.options().dtype(dtype);
    torch::autograd::variable_list out(6);
    if (!grads[0].defined()) {
      out[0] = at::zeros({b * n, d.c, d.fh, d.fw}, opts);
      return out;
    }
    c10::cuda::CUDAGuard guard(uv.device());
    const at::Tensor g = grads[0].to(dtype).contiguous();
    at::Tensor gf = at::empty({b * n, d.c, d.fh, d.fw}, opts);
    const cuda::BevSampleShape s = shape_of(d, dims[4], dims[5]);
    const int64_t ws = cuda::bev_sample_backward_workspace(s);
    at::Tensor workspace = ws > 0 ? at::empty({ws}, uv.options()) : at::Tensor();
    check_launch(
        cuda::bev_sample_backward(detail::dtype_of(g), g.data_ptr(), uv.data_ptr<float>(),
                                  visible.data_ptr<bool>(), count.data_ptr<float>(), gf.data_ptr(),
                                  ws > 0 ? workspace.data_ptr<float>() : nullptr, s,
                                  c10::cuda::getCurrentCUDAStream().stream()),
        "backward");
    out[0] = gf;
    return out;
  }
};

#endif

}  // namespace

bool fused_bev_sample_supported(const at::Tensor& features, const at::Tensor& uv,
                                const at::Tensor& visible) {
#ifdef PARALLAX_WITH_CUDA_KERNELS
  if (!features.defined() || !uv.defined() || !visible.defined()) return false;
  if (!features.is_cuda() || uv.device() != features.device() ||
      visible.device() != features.device())
    return false;
  const auto t = features.scalar_type();
  if (t != at::kFloat && t != at::kBFloat16 && t != at::kHalf) return false;
  if (uv.scalar_type() != at::kFloat || visible.scalar_type() != at::kBool) return false;
  if (features.dim() != 4 || uv.dim() != 4 || visible.dim() != 3) return false;
  if (uv.size(1) < 1 || uv.size(1) > kBevSampleMaxCameras) return false;
  // The kernels read a point's (u, v) as one 8-byte load.
  if (reinterpret_cast<uintptr_t>(uv.data_ptr()) % 8 != 0) return false;
  return features.is_contiguous() && uv.is_contiguous() && visible.is_contiguous();
#else
  (void)features;
  (void)uv;
  (void)visible;
  return false;
#endif
}

BevSample bev_sample(const at::Tensor& features, const at::Tensor& uv, const at::Tensor& visible,
                     int64_t heights, int64_t image_h, int64_t image_w, bool fused) {
  const Dims d = check_dims(features, uv, visible, heights, image_h, image_w);
  const at::Tensor uv32 = uv.detach().to(at::kFloat);  // the geometry is data, sampled in float32
#ifdef PARALLAX_WITH_CUDA_KERNELS
  if (fused && fused_bev_sample_supported(features, uv32, visible)) {
    auto out = FusedBevSample::apply(features, uv32, visible, heights, image_h, image_w);
    return {out[0], out[1]};
  }
#endif
  (void)fused;
  return reference(features, uv32, visible, d, image_h, image_w);
}

}  // namespace parallax::kernels
