// The on-disk dataset schema (docs/data.md): `dataset.json` metadata and one scene's tensors.
//
// `DatasetInfo` is dataset.json in memory; `read_dataset_info` parses it (yaml-cpp reads JSON, a
// subset of YAML 1.2) and checks the schema version and every field; `write_dataset_json` writes it
// atomically (temporary file, then rename). `SceneRecord` is one scene as stored, and
// `check_scene` validates its shapes, dtypes and label ranges against the metadata. All failures
// throw DataError naming the file (and the scene where there is one).
#pragma once

#include "core/scene.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace parallax::data {

// The schema version this code reads and writes (dataset.json and each shard's root attribute).
inline constexpr int64_t kSchemaVersion = 1;

// Columns of a `boxes` row.
enum BoxColumn : int64_t {
  kBoxX = 0,
  kBoxY,
  kBoxZ,
  kBoxL,
  kBoxW,
  kBoxH,
  kBoxYaw,
  kBoxClass,
  kBoxVisibility,
  kBoxColumns
};

struct SplitInfo {
  std::vector<std::string> shards;  // file names relative to the dataset folder
  int64_t scenes = 0;
};

struct BevGrid {
  double x_min = -25, x_max = 25, y_min = -25, y_max = 25, resolution = 0.5;
  int64_t x_cells() const { return static_cast<int64_t>((x_max - x_min) / resolution + 0.5); }
  int64_t y_cells() const { return static_cast<int64_t>((y_max - y_min) / resolution + 0.5); }
};

struct DatasetInfo {
  int64_t schema_version = kSchemaVersion;
  std::string generator;
  int64_t cameras = 6, image_height = 128, image_width = 224;
  // How the shards store camera images: "raw" (uint8 pixels) or "jpeg" (JPEG bytes at
  // `jpeg_quality`, decoded by the reader; docs/data.md, "Image codecs"; 0: a source's JPEG
  // files stored as they are). Absent from an older dataset.json: "raw".
  std::string image_codec = "raw";
  int64_t jpeg_quality = 0;
  BevGrid bev;
  // What bev_semantics was made from, when not the generator's exact labels (a converted dataset:
  // "box footprints" or "map expansion layers and box footprints"); "" otherwise.
  std::string bev_source;
  std::vector<std::string> bev_classes = {"background", "road",       "marking",
                                          "vehicle",    "pedestrian", "cyclist"};
  std::vector<std::string> box_classes = {"vehicle", "pedestrian", "cyclist"};
  std::map<std::string, SplitInfo> splits;
  std::string dir;  // the folder it was read from ("" when built in memory)
  // Sequences (docs/data.md, "Sequences"): scene i of a split is frame i % sequence_length of
  // sequence i / sequence_length (the last one may be shorter), frames `frame_interval` seconds
  // apart. dataset.json holds both keys only when sequence_length > 1; absent: 1 and 0
  // (independent scenes).
  int64_t sequence_length = 1;
  double frame_interval = 0;

  // What the model builder needs; `max_boxes` is the loader's padding of `boxes`.
  core::SceneSpec scene_spec(int64_t max_boxes = 64) const;
  // The split or a DataError listing the splits there are.
  const SplitInfo& split(const std::string& name) const;
};

// Reads and validates `<dir>/dataset.json`. Throws DataError for a missing or malformed file, a
// schema version other than kSchemaVersion, missing/invalid fields (naming the key), or a shard
// entry that is not a file inside `dir` (an absolute path, or one resolving outside the folder
// through '..' or a symlink; naming the key, the entry and where it resolves).
DatasetInfo read_dataset_info(const std::string& dir);
// Writes `<dir>/dataset.json` (atomically). Throws IoError.
void write_dataset_json(const std::string& dir, const DatasetInfo& info);
// The JSON text of dataset.json.
std::string dataset_json(const DatasetInfo& info);

// One scene as stored in a shard (CPU tensors).
struct SceneRecord {
  int64_t index = -1;        // global index within its split
  at::Tensor images;         // uint8 [N, H, W, 3]
  at::Tensor intrinsics;     // float32 [N, 3, 3]
  at::Tensor cam_to_ego;     // float32 [N, 4, 4]
  at::Tensor bev_semantics;  // uint8 [X, Y]
  at::Tensor boxes;          // float32 [K, 9]
  // Optional (a converted dataset; docs/data.md): each box's ground velocity (vx, vy) in the ego
  // frame in m/s, NaN where the source has none, float32 [K, 2]; and the source's id of the
  // sample (the nuScenes sample token), "" when absent.
  at::Tensor velocities;
  std::string sample_token;
  // Optional: the ego frame's pose in the source's global frame, float64 [4, 4] (a converted
  // nuScenes scene: the reference ego pose, the ego origin offset included; a generated
  // sequence's frame: its pose in the sequence's world frame), so detections can be written in
  // the global frame the source's ground truth is in.
  at::Tensor ego_to_global;
  // Optional sequence information (docs/data.md, "Sequences"; absent from a shard of independent
  // scenes, which reads back as the defaults): frame `frame` of sequence `sequence` (ids within
  // the split), its time in microseconds (`timestamp_us`, from the sequence's start for a
  // generated one), the split index of the previous frame (`prev_index`, -1 at a sequence start;
  // a reader refuses one that is not an earlier scene of the split) and each box's identity over
  // its sequence (`instance_ids` int64 [K]).
  int64_t sequence = -1;
  int64_t frame = -1;
  int64_t prev_index = -1;
  int64_t timestamp_us = -1;
  at::Tensor instance_ids;
  // Writer only: each camera's JPEG bytes to store as they are (a converter passing a source's
  // JPEG files through without decoding); `images` is then not read. Needs a JPEG ShardWriter.
  std::vector<std::vector<uint8_t>> jpeg;
};

// The datasets of a scene group, in the order they are written.
inline const std::vector<std::string>& scene_dataset_names() {
  static const std::vector<std::string> kNames = {"images", "intrinsics", "cam_to_ego",
                                                  "bev_semantics", "boxes"};
  return kNames;
}

// The expected shape of dataset `name` ("images", ...); -1 for the free dimension (boxes' K).
std::vector<int64_t> expected_shape(const DatasetInfo& info, const std::string& name);

// Checks dtypes, shapes and label ranges (bev class < |bev_classes|, box class in
// [0, |box_classes|), visibility in [0, 1], finite numbers) and the optional fields
// (check_sequence_fields). `where` names the file and scene.
void check_scene(const SceneRecord& scene, const DatasetInfo& info, const std::string& where);
// The optional fields' part of it (check_scene calls it): velocities float [K, 2] without
// infinities, instance_ids int64 [K], prev_index -1 or an earlier index than the scene's.
void check_sequence_fields(const SceneRecord& scene, const std::string& where);

// "<dir>/<file>" as a string.
std::string join_path(const std::string& dir, const std::string& file);

// "000123": the group name of scene `index` under /scenes.
std::string scene_name(int64_t index);

}  // namespace parallax::data
