// Pinhole projection between the ego frame and camera images, in the conventions of
// docs/data.md: p_ego = cam_to_ego @ p_cam, [u, v, 1]^T ~ K @ p_cam, pixel (i, j) covers
// [i, i+1) x [j, j+1); a point is visible when z_cam > 0.1 m and (u, v) lies in [0, W) x [0, H).
//
// Everything is computed in float32 with elementwise ops (no matmul), so autocast never lowers the
// precision of the geometry; gradients do not flow through it. Shapes: B samples, N cameras,
// P points.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace parallax::models {

inline constexpr double kMinDepth = 0.1;  // metres; nearer points count as not visible

struct Projection {
  at::Tensor uv;     // float32 [B, N, P, 2], pixels
  at::Tensor depth;  // float32 [B, N, P], z in the camera frame, metres
};

// Inverse of rigid transforms [..., 4, 4] (R^T, -R^T t); valid for rotations and reflections
// (a flipped BEV augmentation), not for scaling.
at::Tensor invert_rigid(const at::Tensor& transform);

// [B, N, 3, 4] matrices K @ inverse(cam_to_ego)[:3, :] mapping homogeneous ego points to
// homogeneous pixels. intrinsics [B, N, 3, 3], cam_to_ego [B, N, 4, 4].
at::Tensor ego_to_image(const at::Tensor& intrinsics, const at::Tensor& cam_to_ego);

// Projects ego points [P, 3] (shared by the batch) or [B, P, 3] into every camera.
Projection project_points(const at::Tensor& points_ego, const at::Tensor& intrinsics,
                          const at::Tensor& cam_to_ego);

// bool [B, N, P]: visible per docs/data.md in an image of height x width pixels.
at::Tensor visibility_mask(const Projection& proj, int64_t height, int64_t width);

// Back-projects pixels uv [B, N, P, 2] at depths (z_cam) [B, N, P] to ego points [B, N, P, 3].
at::Tensor unproject_pixels(const at::Tensor& uv, const at::Tensor& depth,
                            const at::Tensor& intrinsics, const at::Tensor& cam_to_ego);

struct Rays {
  at::Tensor origin;     // [B, N, 3] camera centres in the ego frame
  at::Tensor direction;  // [B, N, P, 3] unit directions in the ego frame
};

// The viewing ray through each pixel uv [B, N, P, 2].
Rays pixel_rays(const at::Tensor& uv, const at::Tensor& intrinsics, const at::Tensor& cam_to_ego);

}  // namespace parallax::models
