#include "data/geometry.h"

#include <ATen/ops/eye.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

namespace parallax::data::geom {

Mat3 Mat3::operator*(const Mat3& o) const {
  Mat3 r;
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) {
      r.m[i][j] = m[i][0] * o.m[0][j] + m[i][1] * o.m[1][j] + m[i][2] * o.m[2][j];
    }
  }
  return r;
}

Mat3 Mat3::transpose() const {
  Mat3 r;
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) r.m[i][j] = m[j][i];
  }
  return r;
}

Mat3 Mat3::rot_x(double a) {
  const double c = std::cos(a), s = std::sin(a);
  Mat3 r;
  r.m[1][1] = c;
  r.m[1][2] = -s;
  r.m[2][1] = s;
  r.m[2][2] = c;
  return r;
}

Mat3 Mat3::rot_y(double a) {
  const double c = std::cos(a), s = std::sin(a);
  Mat3 r;
  r.m[0][0] = c;
  r.m[0][2] = s;
  r.m[2][0] = -s;
  r.m[2][2] = c;
  return r;
}

Mat3 Mat3::rot_z(double a) {
  const double c = std::cos(a), s = std::sin(a);
  Mat3 r;
  r.m[0][0] = c;
  r.m[0][1] = -s;
  r.m[1][0] = s;
  r.m[1][1] = c;
  return r;
}

bool Camera::project(const Vec3& p_ego, double& u, double& v, double& depth) const {
  const Vec3 p = cam_to_ego.apply_inverse(p_ego);
  depth = p.z;
  if (p.z <= 1e-9) return false;
  u = K.fx * p.x / p.z + K.cx;
  v = K.fy * p.y / p.z + K.cy;
  return true;
}

bool Camera::sees(const Vec3& p_ego) const {
  double u = 0, v = 0, d = 0;
  if (!project(p_ego, u, v, d) || d <= 0.1) return false;
  return u >= 0 && u < width && v >= 0 && v < height;
}

Vec3 Camera::ray_direction(double u, double v) const {
  return cam_to_ego.R * Vec3{(u - K.cx) / K.fx, (v - K.cy) / K.fy, 1.0};
}

std::vector<RigParams> nominal_rig(int n) {
  std::vector<RigParams> rig;
  const double hfov = std::min(360.0 / n + 20.0, 120.0) * kPi / 180.0;
  for (int k = 0; k < n; ++k) {
    RigParams p;
    p.yaw = wrap_angle(2.0 * kPi * k / n);
    p.pitch = 2.0 * kPi / 180.0;
    p.roll = 0;
    p.position = {0.3 + 1.2 * std::cos(p.yaw), 0.85 * std::sin(p.yaw), 1.6};
    p.hfov = hfov;
    rig.push_back(p);
  }
  return rig;
}

Camera make_camera(const RigParams& p, int height, int width, double focal_scale, double dcx,
                   double dcy) {
  Camera c;
  c.width = width;
  c.height = height;
  const double f = focal_scale * 0.5 * width / std::tan(0.5 * p.hfov);
  c.K = {f, f, 0.5 * width + dcx, 0.5 * height + dcy};
  // Camera axes in the ego frame for a camera looking along +x: x_cam = -y_ego (right),
  // y_cam = -z_ego (down), z_cam = +x_ego (forward). Then pitch down about the camera's x axis,
  // roll about its optical axis, and yaw about the ego's z axis.
  Mat3 base;
  base.m[0][0] = 0;
  base.m[0][1] = 0;
  base.m[0][2] = 1;
  base.m[1][0] = -1;
  base.m[1][1] = 0;
  base.m[1][2] = 0;
  base.m[2][0] = 0;
  base.m[2][1] = -1;
  base.m[2][2] = 0;
  c.cam_to_ego.R = Mat3::rot_z(p.yaw) * base * Mat3::rot_x(-p.pitch) * Mat3::rot_z(p.roll);
  c.cam_to_ego.t = p.position;
  return c;
}

std::array<Vec3, 8> Box::corners() const {
  std::array<Vec3, 8> out;
  const double c = std::cos(yaw), s = std::sin(yaw);
  for (int i = 0; i < 8; ++i) {
    const double lx = (i & 1 ? 0.5 : -0.5) * l;
    const double ly = (i & 2 ? 0.5 : -0.5) * w;
    const double lz = (i & 4 ? 0.5 : -0.5) * h;
    out[i] = {x + c * lx - s * ly, y + s * lx + c * ly, z + lz};
  }
  return out;
}

bool Box::footprint_contains(double px, double py) const {
  const double c = std::cos(yaw), s = std::sin(yaw);
  const double dx = px - x, dy = py - y;
  const double lx = c * dx + s * dy, ly = -s * dx + c * dy;
  return std::abs(lx) <= 0.5 * l && std::abs(ly) <= 0.5 * w;
}

bool Box::footprint_overlaps(const Box& o, double margin) const {
  // Separating axis test on the two rectangles' axes.
  const double a1[2] = {std::cos(yaw), std::sin(yaw)}, b1[2] = {-a1[1], a1[0]};
  const double a2[2] = {std::cos(o.yaw), std::sin(o.yaw)}, b2[2] = {-a2[1], a2[0]};
  const double d[2] = {o.x - x, o.y - y};
  const double h1[2] = {0.5 * l + margin, 0.5 * w + margin},
               h2[2] = {0.5 * o.l + margin, 0.5 * o.w + margin};
  const double* axes[4] = {a1, b1, a2, b2};
  for (const double* ax : axes) {
    const double dist = std::abs(d[0] * ax[0] + d[1] * ax[1]);
    const double r1 = h1[0] * std::abs(a1[0] * ax[0] + a1[1] * ax[1]) +
                      h1[1] * std::abs(b1[0] * ax[0] + b1[1] * ax[1]);
    const double r2 = h2[0] * std::abs(a2[0] * ax[0] + a2[1] * ax[1]) +
                      h2[1] * std::abs(b2[0] * ax[0] + b2[1] * ax[1]);
    if (dist > r1 + r2) return false;
  }
  return true;
}

double wrap_angle(double a) {
  a = std::fmod(a, 2.0 * kPi);
  if (a <= -kPi) a += 2.0 * kPi;
  if (a > kPi) a -= 2.0 * kPi;
  return a;
}

Camera camera_from_tensors(const at::Tensor& K_in, const at::Tensor& T_in, int height, int width) {
  const at::Tensor K = K_in.to(at::kDouble).contiguous(), T = T_in.to(at::kDouble).contiguous();
  const double* k = K.data_ptr<double>();
  const double* t = T.data_ptr<double>();
  Camera c;
  c.height = height;
  c.width = width;
  c.K = {k[0], k[4], k[2], k[5]};
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) c.cam_to_ego.R.m[i][j] = t[i * 4 + j];
  }
  c.cam_to_ego.t = {t[3], t[7], t[11]};
  return c;
}

at::Tensor intrinsics_tensor(const Intrinsics& K) {
  at::Tensor t = at::zeros({3, 3}, at::kFloat);
  float* p = t.data_ptr<float>();
  p[0] = static_cast<float>(K.fx);
  p[2] = static_cast<float>(K.cx);
  p[4] = static_cast<float>(K.fy);
  p[5] = static_cast<float>(K.cy);
  p[8] = 1.0f;
  return t;
}

at::Tensor pose_tensor(const Pose& pose) {
  at::Tensor t = at::eye(4, at::kFloat);
  float* p = t.data_ptr<float>();
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) p[i * 4 + j] = static_cast<float>(pose.R.m[i][j]);
  }
  p[3] = static_cast<float>(pose.t.x);
  p[7] = static_cast<float>(pose.t.y);
  p[11] = static_cast<float>(pose.t.z);
  return t;
}

Camera round_to_float(const Camera& c) {
  auto r = [](double v) { return static_cast<double>(static_cast<float>(v)); };
  Camera o = c;
  o.K = {r(c.K.fx), r(c.K.fy), r(c.K.cx), r(c.K.cy)};
  for (auto& row : o.cam_to_ego.R.m) {
    for (double& v : row) v = r(v);
  }
  o.cam_to_ego.t = {r(c.cam_to_ego.t.x), r(c.cam_to_ego.t.y), r(c.cam_to_ego.t.z)};
  return o;
}

// The largest-diagonal branch, so no division by a small number.
std::array<double, 4> quaternion_wxyz(const Mat3& r) {
  const auto& m = r.m;
  const double tr = m[0][0] + m[1][1] + m[2][2];
  std::array<double, 4> q{};
  if (tr > 0) {
    const double s = 2 * std::sqrt(1 + tr);
    q = {0.25 * s, (m[2][1] - m[1][2]) / s, (m[0][2] - m[2][0]) / s, (m[1][0] - m[0][1]) / s};
  } else if (m[0][0] > m[1][1] && m[0][0] > m[2][2]) {
    const double s = 2 * std::sqrt(1 + m[0][0] - m[1][1] - m[2][2]);
    q = {(m[2][1] - m[1][2]) / s, 0.25 * s, (m[0][1] + m[1][0]) / s, (m[0][2] + m[2][0]) / s};
  } else if (m[1][1] > m[2][2]) {
    const double s = 2 * std::sqrt(1 + m[1][1] - m[0][0] - m[2][2]);
    q = {(m[0][2] - m[2][0]) / s, (m[0][1] + m[1][0]) / s, 0.25 * s, (m[1][2] + m[2][1]) / s};
  } else {
    const double s = 2 * std::sqrt(1 + m[2][2] - m[0][0] - m[1][1]);
    q = {(m[1][0] - m[0][1]) / s, (m[0][2] + m[2][0]) / s, (m[1][2] + m[2][1]) / s, 0.25 * s};
  }
  if (q[0] < 0) {
    for (double& v : q) v = -v;
  }
  return q;
}

}  // namespace parallax::data::geom
