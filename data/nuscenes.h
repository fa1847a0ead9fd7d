// nuScenes in and out (docs/data.md, "nuScenes"):
//
// - `convert_nuscenes` (`parallax convert nuscenes`) reads the nuScenes on-disk layout (the
//   `v1.0-*/*.json` tables and `samples/CAM_*/*.jpg`) and writes a Parallax dataset: one scene per
//   keyframe sample, with the cameras' images (their JPEG bytes as they are, or decoded, resized
//   and re-encoded), intrinsics and camera-to-ego extrinsics, the annotated boxes moved from the
//   global frame into the sample's ego frame with their velocities, BEV labels rasterised from the
//   boxes' footprints, and the sample token.
// - `write_nuscenes_layout` (`parallax datagen --layout nuscenes`) writes synthetic scenes in that
//   layout: the v1.0 tables, JPEG images, a random global ego pose per sample and the boxes in
//   the global frame, so the converter (and nuscenes-devkit) can be tested without the dataset.
//
// The ego frame. nuScenes' ego pose is at the rear axle, on the ground; Parallax's ego frame is on
// the ground below the vehicle's centre. `ego_x_offset` moves the origin forward by that many
// metres (0, the default, keeps nuScenes' rear axle; docs/data.md says which offset suits which
// vehicle). The reference pose of a sample is the ego pose of its LIDAR_TOP keyframe (as the
// devkit's and MMDetection3D's converters use), or of its first camera when there is no lidar;
// each camera's extrinsic includes the ego motion between its own timestamp and the reference.
//
// Conversion is parallel (samples on `workers` threads, written in order), atomic per shard
// (ShardWriter) and resumable: `<out>/convert.json` records the options, and a rerun with the
// same options keeps the shards that are complete and verify (every scene read back through its
// checksums; a shard that fails is converted again, with a warning naming it) and writes the
// rest. dataset.json comes last.
//
// What the tables give is checked before it is used (docs/data.md, "nuScenes"): every path
// (sample_data's `filename`, log's `location`) is relative with no '..' component, so nothing
// outside the dataroot is read (a lexical rule: symlinked folders inside the dataroot work), and
// every number stored as float32 is finite in float32. Values echoed in errors are clipped.
//
// Built without nlohmann-json (PARALLAX_WITH_NUSCENES unset), both throw a UsageError saying so.
#pragma once

#include "data/datagen.h"
#include "data/schema.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace parallax::data {

// Whether this build has the nuScenes converter (nlohmann-json found at configure time).
bool nuscenes_available();

// The nuScenes camera channels in Parallax's rig order (camera k looks at yaw 2 pi k / 6,
// counter-clockwise from the front).
const std::vector<std::string>& nuscenes_cameras();

// The 10 detection classes of the nuScenes detection task and the default category mapping
// (nuScenes category name -> class; categories not listed are ignored and counted).
const std::vector<std::string>& nuscenes_detection_classes();
const std::map<std::string, std::string>& nuscenes_default_category_map();

// The largest --image-size side (as `datagen --height/--width`).
inline constexpr int64_t kNuScenesMaxImageSide = 4096;

struct NuScenesConvertOptions {
  std::string dataroot, version = "v1.0-mini", out;
  std::vector<std::string> cameras;  // empty: nuscenes_cameras()
  int64_t height = 0, width = 0;     // 0: the stored size
  std::string image_codec = "jpeg";  // "jpeg" or "raw"
  int quality = 95;                  // re-encoding quality (jpeg, when the size changes)
  int workers = 0;                   // 0: all cores
  std::string classes_file;          // YAML/JSON {category: class}; "": the default map
  std::string splits_file;           // YAML/JSON {split: [scene names]}; "": see docs/data.md
  double ego_x_offset = 0;           // metres from nuScenes' rear axle to Parallax's origin
  BevGrid bev{-50, 50, -50, 50, 0.5};
  int64_t shard_scenes = 250;
  int compression = 1;  // deflate level of raw images and BEV labels
  bool overwrite = false;
  double progress_interval_s = 5.0;
};

struct NuScenesConvertSummary {
  DatasetInfo info;
  int64_t samples = 0, boxes = 0, ignored_boxes = 0, shards_kept = 0;
  std::map<std::string, int64_t> ignored_categories;  // category -> boxes ignored
  double seconds = 0;
  int64_t bytes = 0;
};

// Converts. UsageError for bad options (a --splits scene the tables do not hold), DataError
// naming the file, table or token for bad input (missing tables, a missing or corrupt JPEG, a
// token that points nowhere, a path leaving the dataroot, a number beyond float32), IoError for
// the filesystem (a full disk: the shard being written is removed, the complete ones stay).
NuScenesConvertSummary convert_nuscenes(const NuScenesConvertOptions& opts);

struct NuScenesLayoutOptions {
  DatagenOptions datagen;  // the scenes (cameras must be 6), seed, threads, JPEG quality
  std::string version = "v1.0-mini";
  int64_t samples_per_scene = 4;  // keyframe samples per nuScenes scene
};

// Writes the synthetic dataset in the nuScenes layout under `datagen.out`: `<version>/*.json`,
// `samples/CAM_*/*.jpg`, and `parallax_splits.json` ({"train": [scene names], "val": [...]},
// the --splits file for the converter). Sample k of split s is datagen's scene k of that split,
// so the converted dataset can be compared with `parallax datagen`'s own for the same options.
void write_nuscenes_layout(const NuScenesLayoutOptions& opts);

}  // namespace parallax::data
