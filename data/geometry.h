// Camera and box geometry in the conventions of docs/data.md, in double precision: the ego frame
// (x forward, y left, z up, metres), OpenCV camera frames (x right, y down, z forward), pinhole
// intrinsics with pixel (i, j) covering [i, i+1) x [j, j+1), yaw counter-clockwise from +x.
//
// The scene generator renders and labels with these types, the augmentation updates them, and the
// tests check the stored tensors against them. Plain value types; thread-compatible.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cmath>
#include <vector>

namespace parallax::data::geom {

inline constexpr double kPi = 3.14159265358979323846;
inline constexpr double kDeg = kPi / 180.0;  // one degree in radians

struct Vec3 {
  double x = 0, y = 0, z = 0;
  Vec3 operator+(const Vec3& o) const { return {x + o.x, y + o.y, z + o.z}; }
  Vec3 operator-(const Vec3& o) const { return {x - o.x, y - o.y, z - o.z}; }
  Vec3 operator*(double s) const { return {x * s, y * s, z * s}; }
  double dot(const Vec3& o) const { return x * o.x + y * o.y + z * o.z; }
  Vec3 cross(const Vec3& o) const {
    return {y * o.z - z * o.y, z * o.x - x * o.z, x * o.y - y * o.x};
  }
  double norm() const { return std::sqrt(dot(*this)); }
  Vec3 normalized() const { return *this * (1.0 / norm()); }
};

struct Mat3 {
  double m[3][3] = {{1, 0, 0}, {0, 1, 0}, {0, 0, 1}};
  Vec3 operator*(const Vec3& v) const {
    return {m[0][0] * v.x + m[0][1] * v.y + m[0][2] * v.z,
            m[1][0] * v.x + m[1][1] * v.y + m[1][2] * v.z,
            m[2][0] * v.x + m[2][1] * v.y + m[2][2] * v.z};
  }
  Mat3 operator*(const Mat3& o) const;
  Mat3 transpose() const;
  static Mat3 rot_x(double a);
  static Mat3 rot_y(double a);
  static Mat3 rot_z(double a);
};

// A rigid transform p' = R p + t (R may be a reflection after a flip augmentation).
struct Pose {
  Mat3 R;
  Vec3 t;
  Vec3 apply(const Vec3& p) const { return R * p + t; }
  // Inverse for orthogonal R (rotation or reflection): R^T (p - t).
  Vec3 apply_inverse(const Vec3& p) const { return R.transpose() * (p - t); }
};

struct Intrinsics {
  double fx = 1, fy = 1, cx = 0, cy = 0;
};

// A pinhole camera of the rig: intrinsics, camera-to-ego pose and image size.
struct Camera {
  Intrinsics K;
  Pose cam_to_ego;
  int width = 0, height = 0;

  // Projects an ego-frame point: (u, v) in pixels and the depth z_cam. Returns false when
  // z_cam <= 1e-9 (then u and v are not set).
  bool project(const Vec3& p_ego, double& u, double& v, double& depth) const;
  // Visible per docs/data.md: depth > 0.1 m and (u, v) inside [0, W) x [0, H).
  bool sees(const Vec3& p_ego) const;
  // Direction (not normalised) in the ego frame of the ray through image point (u, v).
  Vec3 ray_direction(double u, double v) const;
  Vec3 centre() const { return cam_to_ego.t; }
};

// The fixed part of the camera rig: `n` cameras evenly spaced in yaw (camera 0 looks forward along
// +x, camera k at yaw 2 pi k / n, counter-clockwise, i.e. towards the left first), mounted on an
// ellipse around the ego's roof 1.6 m above the ground, pitched 2 degrees down, with a horizontal
// field of view of min(360 / n + 20, 120) degrees, square pixels and the principal point at the
// image centre.
struct RigParams {
  double yaw = 0, pitch = 0, roll = 0;  // radians; pitch > 0 looks down
  Vec3 position;                        // ego frame
  double hfov = 0;                      // radians
};
std::vector<RigParams> nominal_rig(int n);
// Builds a camera from rig parameters and an image size (focal from hfov, centre principal point).
Camera make_camera(const RigParams& p, int height, int width, double focal_scale = 1.0,
                   double dcx = 0, double dcy = 0);

// An oriented 3D box on or above the ground: centre (x, y, z), size (l along yaw, w across, h up).
struct Box {
  double x = 0, y = 0, z = 0, l = 1, w = 1, h = 1, yaw = 0;
  // The 8 corners: bit 0 of the index picks -l/2 or +l/2, bit 1 -w/2 or +w/2, bit 2 -h/2 or +h/2.
  std::array<Vec3, 8> corners() const;
  // Whether the ground point (px, py) lies inside the footprint (closed rectangle).
  bool footprint_contains(double px, double py) const;
  // Whether the footprints of two boxes, each grown by `margin` on every side, intersect.
  bool footprint_overlaps(const Box& o, double margin) const;
  Vec3 centre() const { return {x, y, z}; }
};

// A rotation matrix's unit quaternion [w, x, y, z] (pyquaternion's and nuScenes' order), w >= 0.
std::array<double, 4> quaternion_wxyz(const Mat3& r);

// Wraps an angle to (-pi, pi].
double wrap_angle(double a);

// Conversions to and from the stored float32 tensors ([3, 3] intrinsics, [4, 4] cam_to_ego).
Camera camera_from_tensors(const at::Tensor& K, const at::Tensor& cam_to_ego, int height,
                           int width);
at::Tensor intrinsics_tensor(const Intrinsics& K);
at::Tensor pose_tensor(const Pose& p);
// Rounds every value through float32, so the double math sees exactly what is stored.
Camera round_to_float(const Camera& c);

}  // namespace parallax::data::geom
