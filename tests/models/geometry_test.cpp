// Camera rig and projection geometry against closed-form expectations (docs/data.md frames).
#include "models/geometry.h"
#include "models/camera_rig.h"
#include "tests/common/tolerance.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

namespace parallax::models {
namespace {

namespace tol = parallax::testing;
using tol::u;

// Running error bounds of the fp32 projection of ego points [P, 3] (exact: as given, in double)
// through one camera (K [3, 3], E cam_to_ego [4, 4], both fp32): M = K [R^T | -R^T t] (invert_rigid
// and a product, sums of 3 terms each), uvw = M [p; 1] (a sum of 4), uv = uvw / depth: every
// component within gamma(12) of its magnitude |K| |[R^T | |R^T| |t|]| [|p|; 1] (2 roundings more
// when p itself was rounded to fp32), and u = x / d within (E_x + |u| E_d) / d + u |u|.
struct ProjectionError {
  at::Tensor u, v, depth;  // float64 [P]
};

ProjectionError projection_error(const at::Tensor& points, const at::Tensor& k,
                                 const at::Tensor& cam_to_ego, double roundings = 14) {
  const at::Tensor e = cam_to_ego.to(at::kDouble), p = points.to(at::kDouble);
  const at::Tensor rt = e.narrow(0, 0, 3).narrow(1, 0, 3).t();
  const at::Tensor t = e.narrow(0, 0, 3).narrow(1, 3, 1);
  const at::Tensor m = at::cat({rt, -rt.mm(t)}, 1),
                   m_abs = at::cat({rt.abs(), rt.abs().mm(t.abs())}, 1);
  const at::Tensor ph = at::cat({p, at::ones({p.size(0), 1}, p.options())}, 1);
  const at::Tensor uvw = (k.to(at::kDouble).mm(m)).mm(ph.t());  // [3, P]
  const at::Tensor mag =
      (k.to(at::kDouble).abs().mm(m_abs)).mm(ph.abs().t()) * tol::gamma_k(roundings);
  const at::Tensor d = uvw[2];
  return {(mag[0] + (uvw[0] / d).abs() * mag[2]) / d.abs() + u * (uvw[0] / d).abs(),
          (mag[1] + (uvw[1] / d).abs() * mag[2]) / d.abs() + u * (uvw[1] / d).abs(), mag[2]};
}

TEST(CameraRigTest, SixCamerasAtExpectedYawsLookHorizontally) {
  const CameraRig rig = make_surround_rig({6, 128, 224});
  ASSERT_EQ(rig.intrinsics.sizes(), at::IntArrayRef({6, 3, 3}));
  ASSERT_EQ(rig.cam_to_ego.sizes(), at::IntArrayRef({6, 4, 4}));
  const double f = 112.0 / std::tan(35.0 * std::numbers::pi / 180.0);
  for (int64_t c = 0; c < 6; ++c) {
    const at::Tensor k = rig.intrinsics[c];
    // f computed in double (the same expression up to 4 roundings) and stored as a float.
    EXPECT_NEAR(k[0][0].item<double>(), f, (u + 4 * tol::kFp64Unit) * f);
    EXPECT_NEAR(k[1][1].item<double>(), f, (u + 4 * tol::kFp64Unit) * f);
    EXPECT_EQ(k[0][2].item<double>(), 112.0);  // 0.5 * 224, exact
    EXPECT_EQ(k[1][2].item<double>(), 64.0);
    const at::Tensor e = rig.cam_to_ego[c];
    // The rotation is rot_z(yaw) times axis permutations (entries 0 and +-1) in double: its entries
    // are exactly +-cos(yaw), +-sin(yaw), 0 or -1 (the same yaw, computed by the same expression),
    // each stored as a float: within u of its magnitude.
    const double ax = e[0][2].item<double>(), ay = e[1][2].item<double>(),
                 az = e[2][2].item<double>();
    const double yaw = 2 * std::numbers::pi * static_cast<double>(c) / 6;
    // Optical axis (camera z) in the ego frame: horizontal, at yaw 60 c degrees.
    EXPECT_NEAR(ax, std::cos(yaw), u * std::abs(std::cos(yaw)));
    EXPECT_NEAR(ay, std::sin(yaw), u * std::abs(std::sin(yaw)));
    EXPECT_EQ(az, 0.0);
    // Image down (camera y) is ego -z; image right (camera x) is to the right of the heading.
    EXPECT_EQ(e[2][1].item<double>(), -1.0);
    EXPECT_NEAR(e[0][0].item<double>(), std::sin(yaw), u * std::abs(std::sin(yaw)));
    EXPECT_NEAR(e[1][0].item<double>(), -std::cos(yaw), u * std::abs(std::cos(yaw)));
    EXPECT_NEAR(e[2][3].item<double>(), 1.6, u * 1.6);
    // Proper rotation: the float entries are within u of an orthonormal matrix's (det changes by
    // at most sum |cofactor| u |entry| = 3 u), and det of a 3 x 3 float matrix rounds at most 12
    // times (LU and the product of the pivots, pivots <= 1).
    EXPECT_NEAR(at::linalg_det(e.narrow(0, 0, 3).narrow(1, 0, 3)).item<double>(), 1.0,
                tol::gamma_k(3 + 12));
  }
}

TEST(GeometryTest, PointAheadOfACameraProjectsToItsPrincipalPoint) {
  const CameraRig rig = make_surround_rig({6, 128, 224});
  // 10 m in front of camera 2 (yaw 120 deg), at its mounting height.
  const double yaw = 2 * std::numbers::pi / 3;
  const at::Tensor cam = rig.cam_to_ego[2].narrow(0, 0, 3).select(1, 3);
  const at::Tensor p =
      (cam + 10 * at::tensor({std::cos(yaw), std::sin(yaw), 0.0}, at::kFloat)).view({1, 3});
  const Projection proj =
      project_points(p, rig.intrinsics.unsqueeze(0), rig.cam_to_ego.unsqueeze(0));
  // projection_error() at the exact point: p was itself rounded to fp32 (2 roundings counted).
  const at::Tensor exact =
      (cam.to(at::kDouble) + 10 * at::tensor({std::cos(yaw), std::sin(yaw), 0.0}, at::kDouble))
          .view({1, 3});
  const ProjectionError err = projection_error(exact, rig.intrinsics[2], rig.cam_to_ego[2]);
  EXPECT_NEAR(proj.uv[0][2][0][0].item<double>(), 112.0, err.u.item<double>());
  EXPECT_NEAR(proj.uv[0][2][0][1].item<double>(), 64.0, err.v.item<double>());
  EXPECT_NEAR(proj.depth[0][2][0].item<double>(), 10.0, err.depth.item<double>());
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
  const at::Tensor pts =
      at::stack({r * a.cos(), r * a.sin(), 2 * at::rand({b, p})}, -1);  // [B, P, 3]
  const Projection proj = project_points(pts, rig.intrinsics, rig.cam_to_ego);
  const at::Tensor vis = visibility_mask(proj, 128, 224);  // [B, N, P]
  EXPECT_TRUE(vis.any(1).all().item<bool>()) << "a ring point is not seen by any camera";
  EXPECT_GT(vis.sum().item<int64_t>(), b * p);  // some points are in the overlaps

  const at::Tensor expected = pts.unsqueeze(1).expand({b, 6, p, 3});
  // pixel + depth -> point. The fp32 pixels and depths are within projection_error() of exact;
  // unprojecting, x_cam = (u - cx) d / f (and y, then R x_cam + t: sums of 3 and an add, 4
  // roundings of |R| |x_cam| + |t|), carries them as (E_u d + |u - cx| E_d) / f plus 4 roundings
  // of |u - cx| d / f (and likewise y; E_d itself for z).
  const at::Tensor back = unproject_pixels(proj.uv, proj.depth, rig.intrinsics, rig.cam_to_ego);
  const at::Tensor err = (back - expected).norm(2, -1);
  at::Tensor bound = at::zeros({b, 6, p}, at::kDouble);
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t c = 0; c < 6; ++c) {
      const at::Tensor k = rig.intrinsics[bi][c].to(at::kDouble),
                       e = rig.cam_to_ego[bi][c].to(at::kDouble);
      const ProjectionError pe =
          projection_error(pts[bi], rig.intrinsics[bi][c], rig.cam_to_ego[bi][c]);
      const at::Tensor uv = proj.uv[bi][c].to(at::kDouble),
                       d = proj.depth[bi][c].to(at::kDouble).abs();
      const double f = k[0][0].item<double>(), cx = k[0][2].item<double>(),
                   cy = k[1][2].item<double>();
      const at::Tensor du = (uv.select(-1, 0) - cx).abs(), dv = (uv.select(-1, 1) - cy).abs();
      const at::Tensor ex = (pe.u * d + du * pe.depth) / f + tol::gamma_k(4) * du * d / f;
      const at::Tensor ey = (pe.v * d + dv * pe.depth) / f + tol::gamma_k(4) * dv * d / f;
      const at::Tensor cam_err = at::stack({ex, ey, pe.depth}, -1);  // [P, 3]
      const at::Tensor cam_abs = at::stack({du * d / f, dv * d / f, d}, -1);
      const at::Tensor r = e.narrow(0, 0, 3).narrow(1, 0, 3).abs(),
                       t = e.narrow(0, 0, 3).select(1, 3).abs();
      const at::Tensor ego_err = cam_err.mm(r.t()) + tol::gamma_k(4) * (cam_abs.mm(r.t()) + t);
      bound[bi][c] = ego_err.norm(2, -1);
    }
  }
  EXPECT_TRUE(tol::within(err.masked_select(vis), at::zeros_like(err.masked_select(vis)),
                          bound.masked_select(vis)));
  // pixel -> ray: the point lies on the ray, in front of the camera. The ray's direction is the
  // unprojection at depth 1 minus the origin: its error (the bound above at depth 1, plus 4
  // roundings of the subtraction, the norm and the division, of |point| + |origin|) over its length
  // is an angle, which moves the ray by that times the distance along it; the test's own
  // arithmetic (a sum of 3 and a subtraction) 8 roundings of |rel| + |along|.
  const Rays rays = pixel_rays(proj.uv, rig.intrinsics, rig.cam_to_ego);
  const at::Tensor rel = expected - rays.origin.unsqueeze(2);
  const at::Tensor along = (rel * rays.direction).sum(-1);
  const at::Tensor off = (rel - along.unsqueeze(-1) * rays.direction).norm(2, -1);
  const at::Tensor depth = proj.depth.to(at::kDouble).abs();
  const at::Tensor at_one =
      unproject_pixels(proj.uv, at::ones_like(proj.depth), rig.intrinsics, rig.cam_to_ego)
          .to(at::kDouble);
  const at::Tensor ray = at_one - rays.origin.unsqueeze(2).to(at::kDouble);
  const at::Tensor angle =
      (bound / depth.clamp_min(1e-3) +
       tol::gamma_k(4) *
           (at_one.norm(2, -1) + rays.origin.to(at::kDouble).norm(2, -1).unsqueeze(2))) /
      ray.norm(2, -1);
  const at::Tensor rel_n = rel.to(at::kDouble).norm(2, -1);
  const at::Tensor off_bound =
      rel_n * 2 * angle + tol::gamma_k(8) * (rel_n + along.to(at::kDouble).abs());
  EXPECT_TRUE(tol::within(off.masked_select(vis), at::zeros_like(off.masked_select(vis)),
                          off_bound.masked_select(vis)));
  EXPECT_GT(along.masked_select(vis).min().item<double>(), 0.0);
  // A unit vector: the norm (a sum of 3 squares and a root) and the division, 6 roundings, and
  // the test's norm 5 more.
  EXPECT_LT((rays.direction.norm(2, -1) - 1).abs().max().item<double>(), tol::gamma_k(11));
}

TEST(GeometryTest, VisibilityFollowsTheDataConventions) {
  const CameraRig rig =
      make_surround_rig({1, 100, 200, 90.0, 1.5, 0.0});  // f = 100 px, cx 100, cy 50
  auto project = [&](double x, double y, double z) {
    return project_points(at::tensor({x, y, z}, at::kFloat).view({1, 3}),
                          rig.intrinsics.unsqueeze(0), rig.cam_to_ego.unsqueeze(0));
  };
  // u = cx - f * y / x: y = 1 m left at x = 1 m -> u = 0 exactly (visible: [0, W)). Exact by
  // construction: f = 100, cx = 100, the yaw-0 rotation's entries 0 and +-1 and the point are small
  // integers or halves, so every product and sum is exact.
  Projection edge = project(1.0, 1.0, 1.5);
  EXPECT_EQ(edge.uv[0][0][0][0].item<double>(), 0.0);
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
  // Against the exact (float64) inverse of the fp32 transforms. Their rotations are orthonormal
  // matrices rounded to fp32 (entries within u |r|), so R^T R = I + D with |D| <= 2 u and R^T is
  // within |D| |R|^T <= 2 sqrt(3) u < 4 u of R^-1 per entry; -R^T t is within 4 u sum |t| of
  // -R^-1 t, plus its own 3-term sum's gamma(3) |R|^T |t|. The float64 inverse (LU of a 4 x 4
  // matrix of condition <= (1 + |t|)^2) adds 64 u64 (1 + sum |t|) at most.
  auto expect_rigid_inverse = [](const at::Tensor& t) {
    const at::Tensor t64 = t.to(at::kDouble), exact = at::linalg_inv(t64);
    const at::Tensor r = t64.narrow(-2, 0, 3).narrow(-1, 0, 3),
                     tr = t64.narrow(-2, 0, 3).narrow(-1, 3, 1);
    const at::Tensor sum_t = tr.abs().sum(-2, true);  // [..., 1, 1]
    at::Tensor bound = at::zeros_like(exact);
    bound.narrow(-2, 0, 3).narrow(-1, 0, 3).fill_(4 * u);
    bound.narrow(-2, 0, 3).narrow(-1, 3, 1).copy_(
        4 * u * sum_t + tol::gamma_k(3) * r.abs().transpose(-1, -2).matmul(tr.abs()));
    bound = bound + 64 * tol::kFp64Unit * (1 + sum_t);
    EXPECT_TRUE(tol::within(invert_rigid(t), exact, bound));
  };
  expect_rigid_inverse(rig.cam_to_ego);
  // A BEV flip (y -> -y) applied to the rig stays invertible by the rigid formula.
  const at::Tensor flip = at::diag(at::tensor({1.0f, -1.0f, 1.0f, 1.0f}));
  expect_rigid_inverse(at::matmul(flip, rig.cam_to_ego));  // exact: the flip negates a row
}

}  // namespace
}  // namespace parallax::models
