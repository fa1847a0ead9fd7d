// The nuScenes converter's insides, shared by its source files (not a public header; only
// data/nuscenes*.cpp include it, and only in a build with nlohmann-json):
//
// - nuscenes_tables.cpp: the tables (`Table`, typed field access), the input rules every value
//   from a table passes (numbers finite in float32, paths inside the dataroot, echoes clipped)
//   and the map expansion layers;
// - nuscenes_sample.cpp: `Converter`, one keyframe sample into one SceneRecord;
// - nuscenes.cpp: `convert_nuscenes`, the conversion around it (options, splits, resume, shards);
// - nuscenes_layout.cpp: `write_nuscenes_layout`, the synthetic layout.
//
// Every error is a DataError naming the table file, the record's token and the field, with each
// value from the tables clipped (core::clip), so a hostile table cannot flood the console.
#pragma once

#if PARALLAX_WITH_NUSCENES

#include "data/geometry.h"
#include "data/nuscenes.h"
#include "data/schema.h"

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace parallax::data::nusc {

using json = nlohmann::json;

// ---- Rotations ------------------------------------------------------------------------------

// nuScenes quaternions are [w, x, y, z] (pyquaternion's order).
geom::Mat3 quat_to_mat(double w, double x, double y, double z);
geom::Pose compose(const geom::Pose& a, const geom::Pose& b);  // a after b
geom::Pose inverse(const geom::Pose& p);

// ---- Tables ---------------------------------------------------------------------------------

struct Table {
  std::string name, file;
  json rows;
  std::unordered_map<std::string, const json*> by_token;

  // The record of `token`, or a DataError saying that `referrer` points nowhere.
  const json& at(const std::string& token, const std::string& referrer) const;
};

// "'<file>' record '<token>'" (the token clipped): the prefix of messages about a record.
std::string where(const Table& t, const json& row);

// Typed fields; DataError naming the record and the field when absent or of another type.
const json& field(const Table& t, const json& row, const char* key);
std::string str(const Table& t, const json& row, const char* key);
double num(const Table& t, const json& row, const char* key);
// A list of `n` numbers, each finite in float32 (|x| <= FLT_MAX: the shards store float32, so a
// finite double beyond it, 1e39 or 1e300, is refused here, not written as infinity).
std::vector<double> nums(const Table& t, const json& row, const char* key, size_t n);
// `translation` and `rotation` (a non-zero quaternion) as a pose.
geom::Pose pose_of(const Table& t, const json& row);
// `camera_intrinsic`: a 3 x 3 matrix of numbers finite in float32 with fx, fy > 0, row-major.
std::array<double, 9> intrinsic_of(const Table& t, const json& row);

// `v` as float32 for the value `what` of the record, or a DataError when it is not finite in
// float32 (NaN, infinite, or beyond FLT_MAX). For values computed from the tables (a box centre
// moved into the ego frame).
float to_f32(double v, const Table& t, const json& row, const std::string& what);

// Reads `<dir>/<name>.json`; DataError when missing (unless !required: an empty table), not a
// JSON list, or with a record without a string token or a token twice.
Table load_table(const std::string& dir, const std::string& name, bool required = true);

// Why `path` (a path a table gives relative to the dataroot) may not be opened, or "" when it
// may: it must be relative with no '..' component and no control character. The rule is lexical
// on the table's string, not a check of where the path resolves, so symlinked folders inside the
// dataroot (samples/ on another disk) keep working (docs/data.md, "nuScenes").
std::string table_path_problem(const std::string& path);
// Field `key` of the record (sample_data's `filename`, log's `location`), checked by
// table_path_problem; a DataError naming the table, the token, the field and the path.
std::string table_path(const Table& t, const json& row, const char* key);

// ---- Map expansion layers (maps/expansion/<location>.json, v1.3) ------------------------------

using Pt = std::array<double, 2>;
struct MapShape {
  std::vector<std::vector<Pt>> rings;  // polygon: the exterior, then the holes; line: one ring
  double x0 = 1e300, y0 = 1e300, x1 = -1e300, y1 = -1e300;  // global bounding box
};
// The BEV map classes, painted in this order (later over earlier), before the objects.
enum MapLayer { kWalkway = 0, kDrivable, kCrossing, kDivider, kMapLayers };

struct NuMap {
  std::array<std::vector<MapShape>, kMapLayers> layers;
};

// Reads a map expansion file; `what` names who asked for it (the log record), for the message
// when the file is missing.
NuMap load_map(const std::string& file, const std::string& what);
// The map layers into `bev` (uint8 [X, Y], before the objects): the grid's cell centres taken to
// the global frame by the reference pose's yaw and position (the maps are 2-D), the origin
// `ego_x_offset` metres ahead of the pose.
void paint_map(const NuMap& map, const geom::Pose& ref, const BevGrid& g, double ego_x_offset,
               at::Tensor& bev);

// ---- Files ----------------------------------------------------------------------------------

// The whole file ("" when it cannot be read).
std::string read_text(const std::string& path);

// ---- One sample into one scene (nuscenes_sample.cpp) ----------------------------------------

struct Job {
  std::string split;
  int64_t index = 0;  // within the split
  const json* sample = nullptr;
  // The sample's place in its nuScenes scene (SceneRecord's sequence fields): the scene's number
  // within the split, the sample's index in it and the split index of the previous keyframe.
  int64_t sequence = 0, frame = 0, prev_index = -1;
};

struct Converter {
  NuScenesConvertOptions o;
  std::string dir;  // dataroot/version
  Table sample, sample_data, ego_pose, calibrated_sensor, sensor, annotation, instance, category,
      scene, log;
  std::unordered_map<std::string, std::map<std::string, const json*>> keyframes;  // sample -> ch
  std::unordered_map<std::string, std::vector<const json*>> anns;                 // sample -> anns
  std::map<std::string, std::string> category_class;
  std::map<std::string, int64_t> class_index;
  std::vector<std::string> classes;
  int64_t height = 0, width = 0, stored_h = 0, stored_w = 0;
  bool passthrough = false;
  // Map expansion layers by log location (empty: boxes only).
  std::map<std::string, NuMap> maps;
  uint8_t object_offset = 1;  // bev class of box class c: c + object_offset

  // Counted across worker threads: boxes ignored by category.
  std::mutex m;
  std::map<std::string, int64_t> ignored;
  int64_t boxes = 0;

  // Keyframe sample_data by sample and channel, annotations by sample.
  void index();
  // The bytes of the image of sample_data `sd` (its `filename` checked by table_path); `what`
  // names the sample and camera in messages.
  std::vector<uint8_t> read_image(const json& sd, const std::string& what) const;
  // The keyframe sample_data of `sample_token`'s camera `ch`, or a DataError.
  const json& camera_data(const std::string& sample_token, const std::string& ch) const;
  // One keyframe sample. Thread-safe (the counters are under `m`).
  SceneRecord make(const Job& job);

 private:
  std::string channel_of(const json& sd) const;
  double timestamp_s(const json& ann) const;
  std::array<double, 2> velocity(const json& a) const;
  double visibility_of(const json& a) const;
  const NuMap* map_of(const json& s) const;
  // Camera `c` of the scene: its image, intrinsics and extrinsic into the reference frame.
  void add_camera(SceneRecord& r, int64_t c, const json& sd, const geom::Pose& global_to_ref,
                  const std::string& token) const;
  // The sample's boxes in the reference ego frame; ignored categories counted in `skipped`.
  void add_boxes(SceneRecord& r, const std::string& token, const geom::Pose& global_to_ref,
                 std::map<std::string, int64_t>& skipped) const;
  void rasterise(const at::Tensor& boxes, at::Tensor& bev) const;
};

// ---- The user's files (nuscenes_tables.cpp) -------------------------------------------------

// The category -> class mapping into cv.category_class, cv.classes and cv.class_index (--classes,
// or the detection task's); returns the file's text for convert.json ("" for the default).
// UsageError for a file that is not a {category: class} mapping or maps more than 250 classes.
std::string read_classes(Converter& cv);

struct Splits {
  std::map<std::string, std::string> split_of;  // scene name -> split
  std::string text;                             // the file's text, for convert.json
};
// --splits (none: empty). UsageError for a malformed file, a scene in two splits, or a scene the
// scene table does not hold (naming it and the file: a typo would drop a scene silently).
Splits read_splits(const Converter& cv);

}  // namespace parallax::data::nusc

#endif  // PARALLAX_WITH_NUSCENES
