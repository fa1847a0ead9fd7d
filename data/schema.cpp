#include "data/schema.h"

#include "core/strings.h"

#include "core/error.h"
#include "core/files.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace fs = std::filesystem;

namespace parallax::data {
namespace {

// Typed access to dataset.json's fields with messages naming the file and the key.
class JsonReader {
 public:
  explicit JsonReader(std::string file) : file_(std::move(file)) {}

  YAML::Node child(const YAML::Node& parent, const std::string& key,
                   const std::string& path) const {
    const YAML::Node n = parent[key];
    if (!n.IsDefined() || n.IsNull()) throw_error<DataError>("'{}': missing key '{}'", file_, path);
    return n;
  }
  template <class T>
  T scalar(const YAML::Node& parent, const std::string& key, const std::string& path,
           const char* what) const {
    const YAML::Node n = child(parent, key, path);
    try {
      if (!n.IsScalar()) throw YAML::Exception(YAML::Mark::null_mark(), "not a scalar");
      return n.as<T>();
    } catch (const YAML::Exception&) {
      throw_error<DataError>("'{}': key '{}' must be {}", file_, path, what);
    }
  }
  std::vector<std::string> strings(const YAML::Node& parent, const std::string& key,
                                   const std::string& path) const {
    const YAML::Node n = child(parent, key, path);
    if (!n.IsSequence())
      throw_error<DataError>("'{}': key '{}' must be a list of strings", file_, path);
    std::vector<std::string> out;
    for (size_t i = 0; i < n.size(); ++i) {
      if (!n[i].IsScalar())
        throw_error<DataError>("'{}': key '{}[{}]' must be a string", file_, path, i);
      out.push_back(n[i].as<std::string>());
    }
    return out;
  }
  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

}  // namespace

core::SceneSpec DatasetInfo::scene_spec(int64_t max_boxes) const {
  core::SceneSpec s;
  s.num_cameras = cameras;
  s.image_height = image_height;
  s.image_width = image_width;
  s.x_min = bev.x_min;
  s.x_max = bev.x_max;
  s.y_min = bev.y_min;
  s.y_max = bev.y_max;
  s.bev_resolution = bev.resolution;
  s.bev_classes = bev_classes;
  s.box_classes = box_classes;
  s.max_boxes = max_boxes;
  return s;
}

const SplitInfo& DatasetInfo::split(const std::string& name) const {
  const auto it = splits.find(name);
  if (it == splits.end()) {
    std::vector<std::string> names;
    for (const auto& [k, v] : splits) names.push_back(k);
    throw_error<DataError>("dataset '{}' has no split '{}' (splits: {})", dir, name,
                           fmt::join(names, ", "));
  }
  return it->second;
}

namespace {

// Throws unless `dir` is a directory, saying what it is instead (missing, a file, a symlink loop).
void check_dataset_folder(const std::string& dir) {
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  const std::string shown = core::clip(dir, 200);
  if (st.type() == fs::file_type::not_found)
    throw_error<DataError>("dataset folder '{}' does not exist", shown);
  if (ec) throw_error<DataError>("dataset folder '{}' cannot be read: {}", shown, ec.message());
  if (st.type() == fs::file_type::directory) return;
  std::string hint;
  if (st.type() == fs::file_type::regular) {
    // A shard or dataset.json given instead of the folder that holds them.
    const fs::path parent = fs::path(dir).parent_path();
    if (fs::is_regular_file(parent.empty() ? fs::path("dataset.json") : parent / "dataset.json",
                            ec)) {
      hint = fmt::format(" (did you mean its folder '{}'?)",
                         core::clip(parent.empty() ? "." : parent.string(), 200));
    }
    throw_error<DataError>(
        "'{}' is a file, not a dataset folder (a folder of HDF5 shards and dataset.json){}", shown,
        hint);
  }
  throw_error<DataError>("'{}' is not a dataset folder (not a directory)", shown);
}

// Throws unless shard entry `entry` (key `key` of dataset.json `file`) names a file inside the
// dataset folder `dir`: relative, and resolving ('..' and symlinks followed) strictly below the
// folder's canonical path. So a crafted or careless dataset.json cannot make train, eval or
// inspect read files elsewhere.
void check_shard_inside(const std::string& file, const std::string& dir, const std::string& key,
                        const std::string& entry) {
  const std::string shown = core::clip(entry, 200);
  if (entry.empty())
    throw_error<DataError>("'{}': key '{}' is empty (a shard file name)", file, key);
  if (fs::path(entry).is_absolute()) {
    throw_error<DataError>(
        "'{}': key '{}' is the absolute path '{}'; shards are files inside the dataset folder, "
        "named relative to it",
        file, key, shown);
  }
  std::error_code ec;
  const fs::path root = fs::canonical(dir, ec);
  if (ec) throw_error<DataError>("dataset folder '{}' cannot be resolved: {}", dir, ec.message());
  const fs::path real = fs::weakly_canonical(root / entry, ec);
  if (ec) {
    throw_error<DataError>("'{}': key '{}' ('{}') cannot be resolved: {}", file, key, shown,
                           ec.message());
  }
  // Component-wise prefix: '/data/ds' does not contain '/data/ds2/x'.
  const auto ends = std::mismatch(root.begin(), root.end(), real.begin(), real.end());
  if (ends.first != root.end() || ends.second == real.end()) {
    throw_error<DataError>(
        "'{}': key '{}' is '{}', which resolves to '{}', outside the dataset folder '{}'; shards "
        "must be files inside the dataset folder",
        file, key, shown, core::clip(real.string(), 300), core::clip(root.string(), 300));
  }
}

// `sequence_length` and `frame_interval` (both or neither; absent: independent scenes).
void read_sequence_keys(const JsonReader& r, const YAML::Node& root, const std::string& file,
                        DatasetInfo& info) {
  if (!root["sequence_length"].IsDefined()) {
    if (root["frame_interval"].IsDefined()) {
      throw_error<DataError>("'{}': key 'frame_interval' without 'sequence_length'", file);
    }
    return;
  }
  info.sequence_length =
      r.scalar<int64_t>(root, "sequence_length", "sequence_length", "an integer");
  if (info.sequence_length < 1) {
    throw_error<DataError>("'{}': key 'sequence_length' is {} (must be >= 1)", file,
                           info.sequence_length);
  }
  if (info.sequence_length == 1 && !root["frame_interval"].IsDefined()) return;
  info.frame_interval = r.scalar<double>(root, "frame_interval", "frame_interval", "a number");
  if (!(info.frame_interval > 0) || !std::isfinite(info.frame_interval)) {
    throw_error<DataError>("'{}': key 'frame_interval' is {} (seconds between frames, > 0)", file,
                           info.frame_interval);
  }
}

}  // namespace

DatasetInfo read_dataset_info(const std::string& dir) {
  const std::string file = join_path(dir, "dataset.json");
  check_dataset_folder(dir);
  std::ifstream in(file, std::ios::binary);
  if (!in)
    throw_error<DataError>("'{}' not found: not a Parallax dataset folder (run 'parallax datagen')",
                           file);
  std::stringstream ss;
  ss << in.rdbuf();
  YAML::Node root;
  try {
    root = YAML::Load(ss.str());
  } catch (const YAML::ParserException& e) {
    throw_error<DataError>("'{}':{}:{}: malformed JSON: {}", file, e.mark.line + 1,
                           e.mark.column + 1, e.msg);
  }
  if (!root.IsMap()) throw_error<DataError>("'{}': expected a JSON object at the top level", file);
  const JsonReader r(file);
  DatasetInfo info;
  info.dir = dir;
  info.schema_version = r.scalar<int64_t>(root, "schema_version", "schema_version", "an integer");
  if (info.schema_version != kSchemaVersion) {
    throw_error<DataError>(
        "'{}': schema_version {} is not supported (this build reads version {}); "
        "regenerate or convert the dataset",
        file, info.schema_version, kSchemaVersion);
  }
  if (root["generator"].IsDefined() && root["generator"].IsScalar())
    info.generator = root["generator"].as<std::string>();
  info.cameras = r.scalar<int64_t>(root, "cameras", "cameras", "an integer");
  info.image_height = r.scalar<int64_t>(root, "image_height", "image_height", "an integer");
  info.image_width = r.scalar<int64_t>(root, "image_width", "image_width", "an integer");
  if (info.cameras < 1 || info.image_height < 1 || info.image_width < 1) {
    throw_error<DataError>(
        "'{}': cameras, image_height and image_width must be >= 1 (got {}, {}, {})", file,
        info.cameras, info.image_height, info.image_width);
  }
  if (root["image_codec"].IsDefined()) {
    info.image_codec = r.scalar<std::string>(root, "image_codec", "image_codec", "a string");
    if (info.image_codec != "raw" && info.image_codec != "jpeg") {
      throw_error<DataError>("'{}': key 'image_codec' is '{}' (use \"raw\" or \"jpeg\")", file,
                             info.image_codec);
    }
  }
  if (info.image_codec == "jpeg") {
    info.jpeg_quality = r.scalar<int64_t>(root, "jpeg_quality", "jpeg_quality", "an integer");
    // 0: the source's JPEG files stored as they are (a converted dataset), quality unknown.
    if (info.jpeg_quality < 0 || info.jpeg_quality > 100) {
      throw_error<DataError>(
          "'{}': key 'jpeg_quality' is {} (1..100, or 0 for source JPEGs "
          "stored as they are)",
          file, info.jpeg_quality);
    }
  }
  if (root["bev_source"].IsDefined())
    info.bev_source = r.scalar<std::string>(root, "bev_source", "bev_source", "a string");
  const YAML::Node bev = r.child(root, "bev", "bev");
  info.bev.x_min = r.scalar<double>(bev, "x_min", "bev.x_min", "a number");
  info.bev.x_max = r.scalar<double>(bev, "x_max", "bev.x_max", "a number");
  info.bev.y_min = r.scalar<double>(bev, "y_min", "bev.y_min", "a number");
  info.bev.y_max = r.scalar<double>(bev, "y_max", "bev.y_max", "a number");
  info.bev.resolution = r.scalar<double>(bev, "resolution", "bev.resolution", "a number");
  const auto& g = info.bev;
  if (!(g.resolution > 0) || !(g.x_max > g.x_min) || !(g.y_max > g.y_min)) {
    throw_error<DataError>("'{}': bev needs x_min < x_max, y_min < y_max and resolution > 0", file);
  }
  for (double extent : {g.x_max - g.x_min, g.y_max - g.y_min}) {
    const double cells = extent / g.resolution;
    if (std::abs(cells - std::round(cells)) > 1e-6) {
      throw_error<DataError>("'{}': bev extent {} m is not a whole number of {} m cells", file,
                             extent, g.resolution);
    }
  }
  info.bev_classes = r.strings(root, "bev_classes", "bev_classes");
  info.box_classes = r.strings(root, "box_classes", "box_classes");
  if (info.bev_classes.empty() || info.bev_classes.size() > 255 || info.box_classes.empty()) {
    throw_error<DataError>("'{}': bev_classes needs 1..255 entries and box_classes at least one",
                           file);
  }
  read_sequence_keys(r, root, file, info);
  const YAML::Node splits = r.child(root, "splits", "splits");
  if (!splits.IsMap()) throw_error<DataError>("'{}': key 'splits' must be an object", file);
  for (const auto& kv : splits) {
    const std::string name = kv.first.as<std::string>();
    const std::string path = "splits." + name;
    SplitInfo s;
    s.shards = r.strings(kv.second, "shards", path + ".shards");
    for (size_t i = 0; i < s.shards.size(); ++i)
      check_shard_inside(file, dir, fmt::format("{}.shards[{}]", path, i), s.shards[i]);
    s.scenes = r.scalar<int64_t>(kv.second, "scenes", path + ".scenes", "an integer");
    if (s.scenes < 0) throw_error<DataError>("'{}': key '{}.scenes' must be >= 0", file, path);
    info.splits[name] = std::move(s);
  }
  return info;
}

std::string dataset_json(const DatasetInfo& info) {
  std::string out = "{\n";
  out += fmt::format("  \"schema_version\": {},\n", info.schema_version);
  out += fmt::format("  \"generator\": {},\n", core::json_quote(info.generator));
  out += fmt::format("  \"cameras\": {}, \"image_height\": {}, \"image_width\": {},\n",
                     info.cameras, info.image_height, info.image_width);
  out += fmt::format("  \"image_codec\": {},", core::json_quote(info.image_codec));
  out += info.image_codec == "jpeg" ? fmt::format(" \"jpeg_quality\": {},\n", info.jpeg_quality)
                                    : std::string("\n");
  out += fmt::format(
      "  \"bev\": {{\"x_min\": {}, \"x_max\": {}, \"y_min\": {}, \"y_max\": {}, \"resolution\": "
      "{}}},\n",
      info.bev.x_min, info.bev.x_max, info.bev.y_min, info.bev.y_max, info.bev.resolution);
  if (!info.bev_source.empty())
    out += fmt::format("  \"bev_source\": {},\n", core::json_quote(info.bev_source));
  out += fmt::format("  \"bev_classes\": {},\n", core::json_strings(info.bev_classes));
  out += fmt::format("  \"box_classes\": {},\n", core::json_strings(info.box_classes));
  // Only for sequences, so a dataset of independent scenes keeps its dataset.json byte for byte.
  if (info.sequence_length > 1) {
    out += fmt::format("  \"sequence_length\": {}, \"frame_interval\": {},\n", info.sequence_length,
                       info.frame_interval);
  }
  out += "  \"splits\": {";
  size_t i = 0;
  for (const auto& [name, s] : info.splits) {
    out += fmt::format("{}\n    {}: {{\"shards\": {}, \"scenes\": {}}}", i++ ? "," : "",
                       core::json_quote(name), core::json_strings(s.shards), s.scenes);
  }
  out += "\n  }\n}\n";
  return out;
}

void write_dataset_json(const std::string& dir, const DatasetInfo& info) {
  core::write_file_atomic(join_path(dir, "dataset.json"), dataset_json(info));
}

std::vector<int64_t> expected_shape(const DatasetInfo& info, const std::string& name) {
  if (name == "images") return {info.cameras, info.image_height, info.image_width, 3};
  if (name == "intrinsics") return {info.cameras, 3, 3};
  if (name == "cam_to_ego") return {info.cameras, 4, 4};
  if (name == "bev_semantics") return {info.bev.x_cells(), info.bev.y_cells()};
  if (name == "boxes") return {-1, kBoxColumns};
  throw_error<DataError>("unknown scene dataset '{}'", name);
}

void check_scene(const SceneRecord& s, const DatasetInfo& info, const std::string& where) {
  const std::pair<const char*, const at::Tensor*> fields[] = {{"images", &s.images},
                                                              {"intrinsics", &s.intrinsics},
                                                              {"cam_to_ego", &s.cam_to_ego},
                                                              {"bev_semantics", &s.bev_semantics},
                                                              {"boxes", &s.boxes}};
  for (const auto& [name, t] : fields) {
    if (!t->defined()) throw_error<DataError>("{}: dataset '{}' is missing", where, name);
    const auto want = expected_shape(info, name);
    bool ok = t->dim() == static_cast<int64_t>(want.size());
    for (size_t d = 0; ok && d < want.size(); ++d)
      ok = want[d] < 0 || t->size(static_cast<int64_t>(d)) == want[d];
    if (!ok) {
      std::vector<std::string> w;
      for (int64_t v : want) w.push_back(v < 0 ? "K" : std::to_string(v));
      throw_error<DataError>("{}: dataset '{}' has shape [{}], expected [{}] (from dataset.json)",
                             where, name, fmt::join(t->sizes(), ", "), fmt::join(w, ", "));
    }
  }
  if (s.images.scalar_type() != at::kByte || s.bev_semantics.scalar_type() != at::kByte) {
    throw_error<DataError>("{}: images and bev_semantics must be uint8", where);
  }
  const int64_t n_bev = static_cast<int64_t>(info.bev_classes.size());
  if (s.bev_semantics.numel() > 0 && s.bev_semantics.max().item<int64_t>() >= n_bev) {
    throw_error<DataError>("{}: bev_semantics holds class {} but dataset.json lists {} bev_classes",
                           where, s.bev_semantics.max().item<int64_t>(), n_bev);
  }
  for (const auto& [name, t] :
       {std::pair{"intrinsics", &s.intrinsics}, std::pair{"cam_to_ego", &s.cam_to_ego},
        std::pair{"boxes", &s.boxes}}) {
    if (t->numel() > 0 && !t->isfinite().all().item<bool>()) {
      throw_error<DataError>("{}: dataset '{}' holds NaN or infinite values", where, name);
    }
  }
  if (s.boxes.size(0) > 0) {
    const at::Tensor cls = s.boxes.select(1, kBoxClass);
    const at::Tensor vis = s.boxes.select(1, kBoxVisibility);
    const auto n_box = static_cast<double>(info.box_classes.size());
    if ((cls < 0).any().item<bool>() || (cls >= n_box).any().item<bool>() ||
        (cls != cls.round()).any().item<bool>()) {
      throw_error<DataError>("{}: boxes hold a class outside [0, {}) (box_classes in dataset.json)",
                             where, info.box_classes.size());
    }
    if ((vis < 0).any().item<bool>() || (vis > 1).any().item<bool>()) {
      throw_error<DataError>("{}: boxes hold a visibility outside [0, 1]", where);
    }
  }
  check_sequence_fields(s, where);
}

void check_sequence_fields(const SceneRecord& s, const std::string& where) {
  const int64_t K = s.boxes.size(0);
  if (s.velocities.defined()) {
    if (s.velocities.dim() != 2 || s.velocities.size(0) != K || s.velocities.size(1) != 2 ||
        !s.velocities.is_floating_point()) {
      throw_error<DataError>("{}: velocities [{}] for {} boxes, expected float [{}, 2]", where,
                             fmt::join(s.velocities.sizes(), ", "), K, K);
    }
    if (s.velocities.isinf().any().item<bool>())
      throw_error<DataError>("{}: velocities hold infinite values (NaN marks unknown)", where);
  }
  if (s.instance_ids.defined() && (s.instance_ids.dim() != 1 || s.instance_ids.size(0) != K ||
                                   s.instance_ids.scalar_type() != at::kLong)) {
    throw_error<DataError>("{}: instance_ids [{}] for {} boxes, expected int64 [{}]", where,
                           fmt::join(s.instance_ids.sizes(), ", "), K, K);
  }
  if (s.prev_index != -1 && (s.prev_index < 0 || s.prev_index >= s.index)) {
    throw_error<DataError>("{}: prev_index {} is not an earlier scene of the split (-1, or 0..{})",
                           where, s.prev_index, s.index - 1);
  }
}

std::string join_path(const std::string& dir, const std::string& file) {
  return (fs::path(dir) / file).string();
}

std::string scene_name(int64_t index) {
  return fmt::format("{:06d}", index);
}

}  // namespace parallax::data
