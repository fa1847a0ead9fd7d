#include "models/geometry.h"

#include <ATen/ATen.h>

namespace parallax::models {

namespace {

// a [..., I, K] times b [..., K, J] by broadcasting and summing (no matmul: immune to autocast).
at::Tensor small_matmul(const at::Tensor& a, const at::Tensor& b) {
  return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2);
}

}  // namespace

at::Tensor invert_rigid(const at::Tensor& transform) {
  at::Tensor t = transform.to(at::kFloat);
  at::Tensor rt = t.narrow(-2, 0, 3).narrow(-1, 0, 3).transpose(-1, -2);
  at::Tensor trans = t.narrow(-2, 0, 3).narrow(-1, 3, 1);
  at::Tensor top = at::cat({rt, -small_matmul(rt, trans)}, -1);  // [..., 3, 4]
  at::Tensor bottom = at::zeros_like(t.narrow(-2, 3, 1));
  bottom.select(-1, 3).fill_(1);
  return at::cat({top, bottom}, -2);
}

at::Tensor ego_to_image(const at::Tensor& intrinsics, const at::Tensor& cam_to_ego) {
  at::Tensor ego_to_cam = invert_rigid(cam_to_ego).narrow(-2, 0, 3);  // [B, N, 3, 4]
  return small_matmul(intrinsics.to(at::kFloat), ego_to_cam);
}

Projection project_points(const at::Tensor& points_ego, const at::Tensor& intrinsics,
                          const at::Tensor& cam_to_ego) {
  at::Tensor m = ego_to_image(intrinsics, cam_to_ego);  // [B, N, 3, 4]
  at::Tensor p = points_ego.to(at::kFloat);
  if (p.dim() == 2) p = p.unsqueeze(0);  // [1 or B, P, 3]
  // uvw[b, n, p, r] = sum_c M[b, n, r, c] * p[b, p, c] + M[b, n, r, 3]
  at::Tensor rot = m.narrow(-1, 0, 3);                                          // [B, N, 3, 3]
  at::Tensor uvw = (rot.unsqueeze(2) * p.unsqueeze(1).unsqueeze(-2)).sum(-1) +  // [B, N, P, 3]
                   m.select(-1, 3).unsqueeze(2);
  at::Tensor depth = uvw.select(-1, 2);
  // Points behind the camera still get finite (meaningless) pixels; visibility_mask rejects them.
  at::Tensor safe = at::where(depth.abs() < 1e-6, at::full_like(depth, 1e-6), depth);
  return {uvw.narrow(-1, 0, 2) / safe.unsqueeze(-1), depth};
}

at::Tensor visibility_mask(const Projection& proj, int64_t height, int64_t width) {
  at::Tensor u = proj.uv.select(-1, 0), v = proj.uv.select(-1, 1);
  return (proj.depth > kMinDepth) & (u >= 0) & (u < static_cast<double>(width)) & (v >= 0) &
         (v < static_cast<double>(height));
}

at::Tensor unproject_pixels(const at::Tensor& uv, const at::Tensor& depth,
                            const at::Tensor& intrinsics, const at::Tensor& cam_to_ego) {
  at::Tensor k = intrinsics.to(at::kFloat);
  at::Tensor fx = k.select(-1, 0).select(-1, 0).unsqueeze(-1),
             fy = k.select(-2, 1).select(-1, 1).unsqueeze(-1);
  at::Tensor cx = k.select(-2, 0).select(-1, 2).unsqueeze(-1),
             cy = k.select(-2, 1).select(-1, 2).unsqueeze(-1);
  at::Tensor skew = k.select(-2, 0).select(-1, 1).unsqueeze(-1);
  at::Tensor d = depth.to(at::kFloat);
  at::Tensor y = (uv.select(-1, 1) - cy) / fy;
  at::Tensor x = (uv.select(-1, 0) - cx - skew * y) / fx;
  at::Tensor p_cam = at::stack({x * d, y * d, d}, -1);  // [B, N, P, 3]
  at::Tensor t = cam_to_ego.to(at::kFloat);
  at::Tensor r = t.narrow(-2, 0, 3).narrow(-1, 0, 3);   // [B, N, 3, 3]
  at::Tensor trans = t.narrow(-2, 0, 3).select(-1, 3);  // [B, N, 3]
  return (r.unsqueeze(2) * p_cam.unsqueeze(-2)).sum(-1) + trans.unsqueeze(2);
}

Rays pixel_rays(const at::Tensor& uv, const at::Tensor& intrinsics, const at::Tensor& cam_to_ego) {
  at::Tensor ones = at::ones(uv.sizes().slice(0, uv.dim() - 1), uv.options().dtype(at::kFloat));
  at::Tensor p = unproject_pixels(uv, ones, intrinsics, cam_to_ego);
  at::Tensor origin = cam_to_ego.to(at::kFloat).narrow(-2, 0, 3).select(-1, 3);  // [B, N, 3]
  at::Tensor dir = p - origin.unsqueeze(2);
  return {origin, dir / dir.norm(2, -1, true)};
}

}  // namespace parallax::models
