// Training-time augmentation that keeps images, camera geometry and labels consistent
// (docs/data.md, "Batches"):
// - per camera, an image resize by s and a crop at (ox, oy) back to the original size, applied to
//   K as K' = [[s, 0, -ox], [0, s, -oy], [0, 0, 1]] K (pixel centres map u' = s u - ox);
// - per camera, photometric jitter: brightness, contrast, saturation and a hue rotation;
// - per scene, a BEV transform A = Rz(theta) * Fy (Fy: y -> -y with probability 1/2, then a
// rotation
//   about the ego z axis): cam_to_ego' = A cam_to_ego, box centres and yaws transformed, boxes
//   whose centre leaves the grid dropped, and bev_semantics resampled (nearest cell; cells whose
//   source lies outside the grid repeat the nearest edge cell); then, for box classes that are also
//   BEV classes (matched by name), the object rule of docs/data.md is applied again on the new grid
//   (cells whose centre lies in a moved footprint, and the cell holding a moved centre, take the
//   box's class), so no object is lost or thinned by the resampling. After a flip the 3x3 block of
//   cam_to_ego is a reflection (det -1): invert it as a general rigid transform, never assume
//   det +1.
// Parameters are drawn per (seed, epoch, scene index), so a scene gets the same augmentation
// whichever rank or worker reads it. Functions are pure and thread-safe, and run no LibTorch
// kernels on the image data (plain loops), so worker threads never start intra-op thread pools.
#pragma once

#include "data/schema.h"

#include <cstdint>
#include <vector>

namespace parallax::data {

struct AugmentOptions {
  bool photometric = true;
  double brightness = 0.2;  // factor in [1 - b, 1 + b]
  double contrast = 0.2;    // factor in [1 - c, 1 + c] around the image's mean grey
  double saturation = 0.2;  // factor in [1 - s, 1 + s]
  double hue_deg = 8;       // chroma rotation in [-h, h] degrees (YIQ plane)
  bool geometric = true;
  double resize_min = 0.94, resize_max = 1.12;  // image scale s
  double rotate_deg = 10;                       // BEV rotation in [-r, r] degrees
  bool flip_y = true;  // BEV flip of y with probability 1/2 (needs y_min = -y_max)
};

struct CameraAugment {
  double scale = 1, ox = 0, oy = 0;                                  // resize and crop
  double brightness = 1, contrast = 1, saturation = 1, hue_rad = 0;  // photometric
};

struct AugmentParams {
  std::vector<CameraAugment> cameras;
  double rotation_rad = 0;
  bool flip_y = false;
};

// The parameters for scene `scene` in `epoch` (deterministic).
AugmentParams draw_augment(const AugmentOptions& opts, int64_t cameras, int64_t height,
                           int64_t width, uint64_t seed, int64_t epoch, int64_t scene);

// For each box class, the index of the BEV class of the same name, or -1 (see the file comment).
std::vector<int> box_to_bev_classes(const DatasetInfo& info);

// The model's input when it is not the image as read (data.image_size; docs/data.md): `height`
// x `width`, the read image's coordinates scaled by (sx, sy) first (u -> sx u).
struct ImageFit {
  int64_t height = 0, width = 0;
  double sx = 1, sy = 1;
};

// Applies `p` to a scene (returns new tensors; the input is not modified). `box_to_bev` as from
// box_to_bev_classes (empty: no object re-rasterisation). With `fit`, the images come out at the
// fit's size, resampled once for the fit and the resize (u' = s (sx u) - ox; `p` drawn for the
// fit's size) and K' = [[s sx, 0, -ox], [0, s sy, -oy], [0, 0, 1]] K.
SceneRecord apply_augment(const SceneRecord& scene, const AugmentParams& p, const BevGrid& grid,
                          const std::vector<int>& box_to_bev = {}, const ImageFit* fit = nullptr);
// The fit alone (no augmentation), in place: images resampled to the fit's size, K's first two
// rows scaled by sx and sy.
void fit_images(SceneRecord& scene, const ImageFit& fit);

// The building blocks (exposed for tests).
// Resample one uint8 [H, W, 3] image: dst(i, j) = bilinear(src at ((i + 0.5 + ox) / s - 0.5,
// (j + 0.5 + oy) / s - 0.5)), zero outside the source. `dst` has the same size as `src`.
void resize_crop(const uint8_t* src, uint8_t* dst, int64_t height, int64_t width, double scale,
                 double ox, double oy);
// Resample one uint8 [h_in, w_in, 3] image into [h_out, w_out, 3]: output pixel centre i + 0.5
// shows the source point (i + 0.5 + ox) / sx (continuous coordinates, per axis), through a
// triangle filter of radius max(1, 1/s) source pixels (bilinear for s >= 1, antialiased when
// shrinking), zero outside the source.
void resample(const uint8_t* src, int64_t h_in, int64_t w_in, uint8_t* dst, int64_t h_out,
              int64_t w_out, double sx, double sy, double ox, double oy);
// Photometric jitter in place on one uint8 [H, W, 3] image.
void photometric(uint8_t* img, int64_t height, int64_t width, const CameraAugment& a);
// The 3x3 BEV transform A (row-major) for a rotation and an optional y flip.
std::vector<double> bev_transform(double rotation_rad, bool flip_y);

}  // namespace parallax::data
