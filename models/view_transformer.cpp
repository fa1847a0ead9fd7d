#include "models/view_transformer.h"

#include "core/error.h"
#include "kernels/bev_sample.h"
#include "models/geometry.h"
#include "units/param_init.h"

#include <ATen/ATen.h>

namespace parallax::models {

ViewTransformerImpl::ViewTransformerImpl(const ViewTransformerOptions& o) : opts_(o) {
  PARALLAX_CHECK(!o.heights.empty() && o.grid.nx > 0 && o.grid.ny > 0, ConfigError,
                 "view transformer: need at least one height and a non-empty grid ({} x {})",
                 o.grid.nx, o.grid.ny);
  const int64_t z = static_cast<int64_t>(o.heights.size());
  lift1_ = register_module("lift1", units::layer<QuantConv2d>(torch::nn::Conv2dOptions(
                                        z * o.in_channels + z, o.channels, 1)));
  norm_ = register_module("norm", torch::nn::GroupNorm(norm_groups(o.channels), o.channels));
  lift2_ = register_module(
      "lift2", units::layer<QuantConv2d>(torch::nn::Conv2dOptions(o.channels, o.channels, 1)));
  query_embed_ = register_parameter(
      "query_embed", units::init_normal({1, o.channels, o.grid.nx, o.grid.ny}, 0.02));
}

at::Tensor ViewTransformerImpl::reference_points(const c10::Device& device) const {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const BevGrid& g = opts_.grid;
  at::Tensor x = g.x_min + (at::arange(g.nx, f32) + 0.5) * g.resolution;
  at::Tensor y = g.y_min + (at::arange(g.ny, f32) + 0.5) * g.resolution;
  at::Tensor z = at::tensor(std::vector<float>(opts_.heights.begin(), opts_.heights.end()), f32);
  auto mesh = at::meshgrid({z, x, y}, "ij");  // [Z, nx, ny] each
  return at::stack({mesh[1], mesh[2], mesh[0]}, -1).reshape({-1, 3});
}

ViewTransformerImpl::Sampled ViewTransformerImpl::sample(const at::Tensor& features,
                                                         const at::Tensor& intrinsics,
                                                         const at::Tensor& cam_to_ego) const {
  const int64_t b = intrinsics.size(0), n = intrinsics.size(1);
  const int64_t z = static_cast<int64_t>(opts_.heights.size()), q = opts_.grid.cells();
  PARALLAX_CHECK(features.dim() == 4 && features.size(0) == b * n, Error,
                 "view transformer: features must be [B*N, C, H, W] with B*N = {}, got {}", b * n,
                 fmt::format("{}", features.sizes()));
  const int64_t c = features.size(1);
  at::Tensor points = reference_points(features.device());
  Projection proj = project_points(points, intrinsics, cam_to_ego);  // [B, N, Z*Q, ...]
  at::Tensor visible = visibility_mask(proj, opts_.image_h, opts_.image_w);
  // Normalised sampling coordinates 2u/W - 1 (align_corners=false). Sampling and accumulation
  // run in float32 even under autocast: the backward of grid_sample and scatter_add accumulate
  // with atomics, which are slow (and lossy) in bf16/fp16, and the feature maps are small. The
  // result is cast back to the features' dtype.
  const at::Tensor grid =
      at::stack({proj.uv.select(-1, 0) * (2.0 / static_cast<double>(opts_.map_w())) - 1,
                 proj.uv.select(-1, 1) * (2.0 / static_cast<double>(opts_.map_h())) - 1},
                -1);  // float32 [B, N, P, 2]
  const at::Tensor per_cam =
      features.to(at::kFloat).view({b, n, c, features.size(2), features.size(3)});

  // A reference point is seen by ~1 camera in 5 of a surround rig, so each camera samples only
  // the points it sees: per camera, the visible points of every sample are moved to the front
  // (a stable sort of the mask), the first M = max visible count are sampled (rows past a sample's
  // own count are parked outside the map and weighted 0), and all samples are scatter-added into
  // the [B, C, P] accumulator. One host sync reads the M of every camera.
  const at::Tensor visible_count = visible.sum(2);  // [B, N]
  const at::Tensor max_count = std::get<0>(visible_count.max(0)).cpu();
  std::vector<at::Tensor> samples, indices;
  for (int64_t cam = 0; cam < n; ++cam) {
    const int64_t m = max_count[cam].item<int64_t>();
    if (m == 0) continue;
    const at::Tensor vis = visible.select(1, cam);  // [B, P]
    const at::Tensor idx = std::get<1>(at::sort((~vis).to(at::kByte), /*stable=*/true, /*dim=*/1,
                                                /*descending=*/false))
                               .narrow(1, 0, m);
    const at::Tensor keep = vis.gather(1, idx);  // [B, M]
    at::Tensor g = grid.select(1, cam).gather(1, idx.unsqueeze(-1).expand({b, m, 2}));
    g = at::where(keep.unsqueeze(-1), g, at::full({}, -2.0, g.options()));
    // [B, C, 1, M]: bilinear, zero padding, pixel-area convention of docs/data.md.
    at::Tensor s = at::grid_sampler(per_cam.select(1, cam), g.unsqueeze(1), 0, 0, false).squeeze(2);
    samples.push_back(s * keep.to(s.scalar_type()).unsqueeze(1));
    indices.push_back(idx);
  }
  const int64_t p = z * q;
  at::Tensor acc =
      at::zeros({b, c, p}, per_cam.options().memory_format(at::MemoryFormat::Contiguous));
  if (!samples.empty()) {
    const at::Tensor idx = at::cat(indices, 1);
    acc = acc.scatter_add(2, idx.unsqueeze(1).expand({b, c, idx.size(1)}), at::cat(samples, 2));
  }
  at::Tensor count = visible.to(at::kFloat).sum(1).view({b, z, q});
  return {(acc / count.clamp_min(1).view({b, 1, p})).to(features.scalar_type()).view({b, c, z, q}),
          count};
}

at::Tensor ViewTransformerImpl::forward(const at::Tensor& features, const at::Tensor& intrinsics,
                                        const at::Tensor& cam_to_ego) {
  const int64_t b = intrinsics.size(0), nx = opts_.grid.nx, ny = opts_.grid.ny;
  at::Tensor x;  // [B, C*Z + Z, nx, ny]: per-height means, then per-height seen flags
  if (opts_.fused_kernels && features.is_cuda()) {
    const Projection proj =
        project_points(reference_points(features.device()), intrinsics, cam_to_ego);
    const at::Tensor visible = visibility_mask(proj, opts_.image_h, opts_.image_w);
    const at::Tensor f = features.contiguous();  // e.g. a channels-last map from a conv neck
    if (kernels::fused_bev_sample_supported(f, proj.uv, visible)) {
      const int64_t z = static_cast<int64_t>(opts_.heights.size());
      x = kernels::bev_sample(f, proj.uv, visible, z, opts_.map_h(), opts_.map_w())
              .lifted.view({b, -1, nx, ny});
    }
  }
  if (!x.defined()) {
    Sampled s = sample(features, intrinsics, cam_to_ego);
    const int64_t zc = s.features.size(1) * s.features.size(2);
    at::Tensor seen = (s.count > 0).to(s.features.scalar_type()).view({b, -1, nx, ny});
    x = at::cat({s.features.view({b, zc, nx, ny}), seen}, 1);
  }
  x = lift2_->forward(norm_->forward(lift1_->forward(x)).relu_());
  return x + query_embed_;
}

Cost ViewTransformerImpl::analytic_cost(const ViewTransformerOptions& o) {
  const int64_t z = static_cast<int64_t>(o.heights.size());
  const int64_t nx = o.grid.nx, ny = o.grid.ny;
  return conv_cost(z * o.in_channels + z, o.channels, 1, true, nx, ny) + Cost{2 * o.channels, 0.0} +
         conv_cost(o.channels, o.channels, 1, true, nx, ny) + Cost{o.channels * nx * ny, 0.0};
}

}  // namespace parallax::models
