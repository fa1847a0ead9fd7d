// A surround camera rig in the conventions of docs/data.md (ego: x forward, y left, z up;
// camera: OpenCV x right, y down, z forward): N pinhole cameras evenly spaced in yaw (6 cameras
// at 0, +-60, +-120, 180 degrees), mounted at a given height and looking horizontally. Used by the
// model zoo's example batches and tests; the data layer's renderer has its own rig.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace parallax::models {

struct RigOptions {
  int64_t num_cameras = 6;
  int64_t image_height = 128;
  int64_t image_width = 224;
  double hfov_deg = 70.0;     // horizontal field of view of every camera (overlap for 6 cameras)
  double mount_height = 1.6;  // metres above the ground
  double mount_radius = 1.0;  // cameras sit this far from the ego origin, along their yaw
};

struct CameraRig {
  at::Tensor intrinsics;  // float32 [N, 3, 3]
  at::Tensor cam_to_ego;  // float32 [N, 4, 4]
};

// Camera k has yaw 2 pi k / N (counter-clockwise from ego +x); focal length
// f = (W / 2) / tan(hfov / 2) for both axes, principal point at the image centre.
CameraRig make_surround_rig(const RigOptions& o = {});

// `n` copies of `rig` with small random mounting perturbations (yaw, pitch and roll up to
// `max_angle_deg`, height up to `max_height_m`), drawn from the default CPU generator:
// intrinsics [n, N, 3, 3], cam_to_ego [n, N, 4, 4].
CameraRig jitter_rig(const CameraRig& rig, int64_t n, double max_angle_deg = 2.0,
                     double max_height_m = 0.1);

// Rotation matrix (float32 [3, 3]) of a camera with the given yaw, pitch (positive looks down) and
// roll around its optical axis, mapping camera-frame directions to the ego frame.
at::Tensor camera_rotation(double yaw, double pitch = 0.0, double roll = 0.0);

}  // namespace parallax::models
