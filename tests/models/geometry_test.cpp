// Camera rig and projection geometry against closed-form expectations (docs/data.md frames).
#include "models/camera_rig.h"
#include "models/geometry.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

namespace parallax::models {
namespace {

TEST(CameraRigTest, SixCamerasAtExpectedYawsLookHorizontally) {
  const CameraRig rig = make_surround_rig({6, 128, 224});
  ASSERT_EQ(rig.intrinsics.sizes(), at::IntArrayRef({6, 3, 3}));
  ASSERT_EQ(rig.cam_to_ego.sizes(), at::IntArrayRef({6, 4, 4}));
  const double f = 112.0 / std::tan(35.0 * std::numbers::pi / 180.0);
  for (int64_t c = 0; c < 6; ++c) {
    const at::Tensor k = rig.intrinsics[c];
    EXPECT_NEAR(k[0][0].item<double>(), f, 1e-3);
    EXPECT_NEAR(k[1][1].item<double>(), f, 1e-3);
    EXPECT_NEAR(k[0][2].item<double>(), 112.0, 1e-6);
    EXPECT_NEAR(k[1][2].item<double>(), 64.0, 1e-6);
    const at::Tensor e = rig.cam_to_ego[c];
    // Optical axis (camera z) in the ego frame: horizontal, at yaw 60 c degrees.
    const double ax = e[0][2].item<double>(), ay = e[1][2].item<double>(), az = e[2][2].item<double>();
    const double yaw = 2 * std::numbers::pi * static_cast<double>(c) / 6;
    EXPECT_NEAR(ax, std::cos(yaw), 1e-6);
    EXPECT_NEAR(ay, std::sin(yaw), 1e-6);
    EXPECT_NEAR(az, 0.0, 1e-6);
    // Image down (camera y) is ego -z; image right (camera x) is to the right of the heading.
    EXPECT_NEAR(e[2][1].item<double>(), -1.0, 1e-6);
    EXPECT_NEAR(e[0][0].item<double>(), std::sin(yaw), 1e-6);
    EXPECT_NEAR(e[1][0].item<double>(), -std::cos(yaw), 1e-6);
    EXPECT_NEAR(e[2][3].item<double>(), 1.6, 1e-6);
    // Proper rotation.
    EXPECT_NEAR(at::linalg_det(e.narrow(0, 0, 3).narrow(1, 0, 3)).item<double>(), 1.0, 1e-5);
  }
}

TEST(GeometryTest, PointAheadOfACameraProjectsToItsPrincipalPoint) {
  const CameraRig rig = make_surround_rig({6, 128, 224});
  // 10 m in front of camera 2 (yaw 120 deg), at its mounting height.
  const double yaw = 2 * std::numbers::pi / 3;
  const at::Tensor cam = rig.cam_to_ego[2].narrow(0, 0, 3).select(1, 3);
  const at::Tensor p = (cam + 10 * at::tensor({std::cos(yaw), std::sin(yaw), 0.0}, at::kFloat)).view({1, 3});
  const Projection proj = project_points(p, rig.intrinsics.unsqueeze(0), rig.cam_to_ego.unsqueeze(0));
  EXPECT_NEAR(proj.uv[0][2][0][0].item<double>(), 112.0, 1e-3);
  EXPECT_NEAR(proj.uv[0][2][0][1].item<double>(), 64.0, 1e-3);
  EXPECT_NEAR(proj.depth[0][2][0].item<double>(), 10.0, 1e-4);
  const at::Tensor vis = visibility_mask(proj, 128, 224)[0].select(1, 0);
  EXPECT_TRUE(vis[2].item<bool>());
  // Cameras 1 and 3 are 60 degrees away: outside their 70 degree field of view; 5 faces away.
  EXPECT_FALSE(vis[1].item<bool>());
  EXPECT_FALSE(vis[3].item<bool>());
  EXPECT_FALSE(vis[5].item<bool>());
  EXPECT_LT(proj.depth[0][5][0].item<double>(), 0.0);
}

TEST(GeometryTest, ProjectionRoundTripAcrossAllCameras) {
  at::manual_seed(11);
  const int64_t b = 2, p = 400;
  const CameraRig rig = jitter_rig(make_surround_rig({6, 128, 224}), b, 3.0, 0.2);
  // Points on a ring 8-30 m around the ego, 0-2 m high: every one is seen by some camera.
  const at::Tensor r = 8 + 22 * at::rand({b, p}), a = (at::rand({b, p}) * 2 - 1) * std::numbers::pi;
  const at::Tensor pts = at::stack({r * a.cos(), r * a.sin(), 2 * at::rand({b, p})}, -1);  // [B, P, 3]
  const Projection proj = project_points(pts, rig.intrinsics, rig.cam_to_ego);
  const at::Tensor vis = visibility_mask(proj, 128, 224);  // [B, N, P]
  EXPECT_TRUE(vis.any(1).all().item<bool>()) << "a ring point is not seen by any camera";
  EXPECT_GT(vis.sum().item<int64_t>(), b * p);  // some points are in the overlaps

  const at::Tensor expected = pts.unsqueeze(1).expand({b, 6, p, 3});
  // pixel + depth -> point.
  const at::Tensor back = unproject_pixels(proj.uv, proj.depth, rig.intrinsics, rig.cam_to_ego);
  const at::Tensor err = (back - expected).norm(2, -1);
  EXPECT_LT(err.masked_select(vis).max().item<double>(), 2e-4 * 30);
  // pixel -> ray: the point lies on the ray, in front of the camera.
  const Rays rays = pixel_rays(proj.uv, rig.intrinsics, rig.cam_to_ego);
  const at::Tensor rel = expected - rays.origin.unsqueeze(2);
  const at::Tensor along = (rel * rays.direction).sum(-1);
  const at::Tensor off = (rel - along.unsqueeze(-1) * rays.direction).norm(2, -1);
  EXPECT_LT(off.masked_select(vis).max().item<double>(), 1e-3);
  EXPECT_GT(along.masked_select(vis).min().item<double>(), 0.0);
  EXPECT_LT((rays.direction.norm(2, -1) - 1).abs().max().item<double>(), 1e-5);
}

TEST(GeometryTest, VisibilityFollowsTheDataConventions) {
  const CameraRig rig = make_surround_rig({1, 100, 200, 90.0, 1.5, 0.0});  // f = 100 px, cx 100, cy 50
  auto project = [&](double x, double y, double z) {
    return project_points(at::tensor({x, y, z}, at::kFloat).view({1, 3}), rig.intrinsics.unsqueeze(0),
                          rig.cam_to_ego.unsqueeze(0));
  };
  // u = cx - f * y / x: y = 1 m left at x = 1 m -> u = 0 exactly (visible: [0, W)).
  Projection edge = project(1.0, 1.0, 1.5);
  EXPECT_NEAR(edge.uv[0][0][0][0].item<double>(), 0.0, 1e-5);
  // Right edge u = W is outside; nudge inside.
  EXPECT_FALSE(visibility_mask(project(1.0, -1.0, 1.5), 100, 200).item<bool>());
  EXPECT_TRUE(visibility_mask(project(1.0, -0.99, 1.5), 100, 200).item<bool>());
  // Too near (depth <= 0.1 m) and behind are invisible even when the pixel is inside the image.
  EXPECT_FALSE(visibility_mask(project(0.05, 0.0, 1.5), 100, 200).item<bool>());
  EXPECT_FALSE(visibility_mask(project(-5.0, 0.0, 1.5), 100, 200).item<bool>());
  EXPECT_TRUE(visibility_mask(project(5.0, 0.0, 1.5), 100, 200).item<bool>());
}

TEST(GeometryTest, RigidInverseMatchesGeneralInverse) {
  at::manual_seed(3);
  const CameraRig rig = jitter_rig(make_surround_rig({6, 128, 224}), 3, 10.0, 0.5);
  EXPECT_TRUE(at::allclose(invert_rigid(rig.cam_to_ego), at::linalg_inv(rig.cam_to_ego), 1e-5, 1e-5));
  // A BEV flip (y -> -y) applied to the rig stays invertible by the rigid formula.
  const at::Tensor flip = at::diag(at::tensor({1.0f, -1.0f, 1.0f, 1.0f}));
  const at::Tensor flipped = at::matmul(flip, rig.cam_to_ego);
  EXPECT_TRUE(at::allclose(invert_rigid(flipped), at::linalg_inv(flipped), 1e-5, 1e-5));
}

}  // namespace
}  // namespace parallax::models
