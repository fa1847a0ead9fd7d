#include "models/camera_rig.h"

#include "core/error.h"

#include <ATen/ATen.h>

#include <array>
#include <cmath>
#include <numbers>

namespace parallax::models {

namespace {

using Mat3 = std::array<std::array<double, 3>, 3>;

Mat3 mul(const Mat3& a, const Mat3& b) {
  Mat3 c{};
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 3; ++k) c[i][j] += a[i][k] * b[k][j];
  return c;
}

Mat3 rot_z(double a) {
  return {{{std::cos(a), -std::sin(a), 0}, {std::sin(a), std::cos(a), 0}, {0, 0, 1}}};
}

// Camera axes in the ego frame for a camera looking along ego +x: columns are x_cam (right = -y),
// y_cam (down = -z) and z_cam (forward = +x).
constexpr Mat3 kCamToEgoAxes = {{{0, 0, 1}, {-1, 0, 0}, {0, -1, 0}}};

// In the camera's own frame: pitch tilts the optical axis towards +y_cam (down), roll turns the
// image around the optical axis.
Mat3 cam_pitch(double p) {
  return {{{1, 0, 0}, {0, std::cos(p), std::sin(p)}, {0, -std::sin(p), std::cos(p)}}};
}
Mat3 cam_roll(double r) {
  return {{{std::cos(r), -std::sin(r), 0}, {std::sin(r), std::cos(r), 0}, {0, 0, 1}}};
}

Mat3 rotation(double yaw, double pitch, double roll) {
  return mul(mul(mul(rot_z(yaw), kCamToEgoAxes), cam_pitch(pitch)), cam_roll(roll));
}

at::Tensor to_tensor(const Mat3& m) {
  at::Tensor t = at::empty({3, 3}, at::kFloat);
  auto a = t.accessor<float, 2>();
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 3; ++j) a[i][j] = static_cast<float>(m[i][j]);
  return t;
}

}  // namespace

at::Tensor camera_rotation(double yaw, double pitch, double roll) {
  return to_tensor(rotation(yaw, pitch, roll));
}

CameraRig make_surround_rig(const RigOptions& o) {
  PARALLAX_CHECK(o.num_cameras >= 1 && o.image_height > 0 && o.image_width > 0 && o.hfov_deg > 0 &&
                     o.hfov_deg < 180,
                 ConfigError, "camera rig: invalid options ({} cameras, {}x{} pixels, hfov {} deg)",
                 o.num_cameras, o.image_height, o.image_width, o.hfov_deg);
  const int64_t n = o.num_cameras;
  const double f = 0.5 * static_cast<double>(o.image_width) /
                   std::tan(0.5 * o.hfov_deg * std::numbers::pi / 180.0);
  at::Tensor k = at::zeros({n, 3, 3}, at::kFloat);
  at::Tensor e = at::zeros({n, 4, 4}, at::kFloat);
  auto ka = k.accessor<float, 3>();
  auto ea = e.accessor<float, 3>();
  for (int64_t c = 0; c < n; ++c) {
    ka[c][0][0] = static_cast<float>(f);
    ka[c][1][1] = static_cast<float>(f);
    ka[c][0][2] = static_cast<float>(0.5 * o.image_width);
    ka[c][1][2] = static_cast<float>(0.5 * o.image_height);
    ka[c][2][2] = 1.0f;
    const double yaw = 2.0 * std::numbers::pi * static_cast<double>(c) / static_cast<double>(n);
    const Mat3 r = rotation(yaw, 0.0, 0.0);
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 3; ++j) ea[c][i][j] = static_cast<float>(r[i][j]);
    ea[c][0][3] = static_cast<float>(o.mount_radius * std::cos(yaw));
    ea[c][1][3] = static_cast<float>(o.mount_radius * std::sin(yaw));
    ea[c][2][3] = static_cast<float>(o.mount_height);
    ea[c][3][3] = 1.0f;
  }
  return {k, e};
}

CameraRig jitter_rig(const CameraRig& rig, int64_t n, double max_angle_deg, double max_height_m) {
  const int64_t cams = rig.intrinsics.size(0);
  const double a = max_angle_deg * std::numbers::pi / 180.0;
  at::Tensor u =
      at::rand({n, cams, 4}, at::kDouble) * 2 - 1;  // yaw, pitch, roll, height in [-1, 1)
  at::Tensor base = rig.cam_to_ego.to(at::kDouble).contiguous();
  at::Tensor e = at::empty({n, cams, 4, 4}, at::kFloat);
  auto ua = u.accessor<double, 3>();
  auto ba = base.accessor<double, 3>();
  auto ea = e.accessor<float, 4>();
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t c = 0; c < cams; ++c) {
      Mat3 r{};
      for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 3; ++j) r[i][j] = ba[c][i][j];
      r = mul(mul(mul(rot_z(a * ua[s][c][0]), r), cam_pitch(a * ua[s][c][1])),
              cam_roll(a * ua[s][c][2]));
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j)
          ea[s][c][i][j] = static_cast<float>(i < 3 && j < 3 ? r[i][j] : ba[c][i][j]);
      ea[s][c][2][3] = static_cast<float>(ba[c][2][3] + max_height_m * ua[s][c][3]);
    }
  }
  return {rig.intrinsics.unsqueeze(0).expand({n, cams, 3, 3}).contiguous(), e};
}

}  // namespace parallax::models
