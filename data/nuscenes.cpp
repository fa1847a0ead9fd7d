#include "data/nuscenes.h"

#include "core/error.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/rng.h"
#include "core/strings.h"
#include "data/geometry.h"
#include "data/jpeg.h"
#include "data/ordered_pool.h"
#include "data/shard.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#if PARALLAX_WITH_NUSCENES
#include <nlohmann/json.hpp>
#endif

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

namespace fs = std::filesystem;

namespace parallax::data {

const std::vector<std::string>& nuscenes_cameras() {
  static const std::vector<std::string> k = {"CAM_FRONT", "CAM_FRONT_LEFT", "CAM_BACK_LEFT",
                                             "CAM_BACK",  "CAM_BACK_RIGHT", "CAM_FRONT_RIGHT"};
  return k;
}

const std::vector<std::string>& nuscenes_detection_classes() {
  static const std::vector<std::string> k = {
      "car",        "truck",      "bus",     "trailer",      "construction_vehicle",
      "pedestrian", "motorcycle", "bicycle", "traffic_cone", "barrier"};
  return k;
}

const std::map<std::string, std::string>& nuscenes_default_category_map() {
  // The nuScenes detection task's grouping of the 23 annotation categories into 10 classes
  // (the categories not listed, e.g. animal or static_object.bicycle_rack, are not evaluated).
  static const std::map<std::string, std::string> k = {
      {"vehicle.car", "car"},
      {"vehicle.truck", "truck"},
      {"vehicle.bus.bendy", "bus"},
      {"vehicle.bus.rigid", "bus"},
      {"vehicle.trailer", "trailer"},
      {"vehicle.construction", "construction_vehicle"},
      {"human.pedestrian.adult", "pedestrian"},
      {"human.pedestrian.child", "pedestrian"},
      {"human.pedestrian.construction_worker", "pedestrian"},
      {"human.pedestrian.police_officer", "pedestrian"},
      {"vehicle.motorcycle", "motorcycle"},
      {"vehicle.bicycle", "bicycle"},
      {"movable_object.trafficcone", "traffic_cone"},
      {"movable_object.barrier", "barrier"}};
  return k;
}

#if !PARALLAX_WITH_NUSCENES

bool nuscenes_available() {
  return false;
}

namespace {
[[noreturn]] void not_built() {
  throw UsageError(
      "this build has no nuScenes support (nlohmann-json was not found when it was built; install "
      "nlohmann-json3-dev and rebuild)");
}
}  // namespace

NuScenesConvertSummary convert_nuscenes(const NuScenesConvertOptions&) {
  not_built();
}
void write_nuscenes_layout(const NuScenesLayoutOptions&) {
  not_built();
}

#else

bool nuscenes_available() {
  return true;
}

namespace {

using json = nlohmann::json;

// ---- Rotations ------------------------------------------------------------------------------

// nuScenes quaternions are [w, x, y, z] (pyquaternion's order).
geom::Mat3 quat_to_mat(double w, double x, double y, double z) {
  const double n = std::sqrt(w * w + x * x + y * y + z * z);
  w /= n, x /= n, y /= n, z /= n;
  geom::Mat3 r;
  r.m[0][0] = 1 - 2 * (y * y + z * z);
  r.m[0][1] = 2 * (x * y - w * z);
  r.m[0][2] = 2 * (x * z + w * y);
  r.m[1][0] = 2 * (x * y + w * z);
  r.m[1][1] = 1 - 2 * (x * x + z * z);
  r.m[1][2] = 2 * (y * z - w * x);
  r.m[2][0] = 2 * (x * z - w * y);
  r.m[2][1] = 2 * (y * z + w * x);
  r.m[2][2] = 1 - 2 * (x * x + y * y);
  return r;
}

geom::Pose compose(const geom::Pose& a, const geom::Pose& b) {  // a after b
  return {a.R * b.R, a.R * b.t + a.t};
}
geom::Pose inverse(const geom::Pose& p) {
  const geom::Mat3 rt = p.R.transpose();
  return {rt, rt * (p.t * -1.0)};
}

// ---- Tables ---------------------------------------------------------------------------------

struct Table {
  std::string name, file;
  json rows;
  std::unordered_map<std::string, const json*> by_token;

  const json& at(const std::string& token, const std::string& referrer) const {
    const auto it = by_token.find(token);
    if (it == by_token.end()) {
      throw_error<DataError>("nuScenes: {} points to {} token '{}', which '{}' does not hold",
                             referrer, name, token, file);
    }
    return *it->second;
  }
};

std::string where(const Table& t, const json& row) {
  const auto it = row.find("token");
  return fmt::format("'{}' record '{}'", t.file,
                     it != row.end() && it->is_string() ? it->get<std::string>() : "?");
}

const json& field(const Table& t, const json& row, const char* key) {
  const auto it = row.find(key);
  if (it == row.end()) throw_error<DataError>("nuScenes: {} has no field '{}'", where(t, row), key);
  return *it;
}
std::string str(const Table& t, const json& row, const char* key) {
  const json& v = field(t, row, key);
  if (!v.is_string())
    throw_error<DataError>("nuScenes: {} field '{}' is not a string", where(t, row), key);
  return v.get<std::string>();
}
double num(const Table& t, const json& row, const char* key) {
  const json& v = field(t, row, key);
  if (!v.is_number())
    throw_error<DataError>("nuScenes: {} field '{}' is not a number", where(t, row), key);
  return v.get<double>();
}
std::vector<double> nums(const Table& t, const json& row, const char* key, size_t n) {
  const json& v = field(t, row, key);
  std::vector<double> out;
  if (v.is_array()) {
    for (const auto& e : v) {
      if (!e.is_number()) break;
      out.push_back(e.get<double>());
    }
  }
  if (out.size() != n || !v.is_array() || v.size() != n) {
    throw_error<DataError>("nuScenes: {} field '{}' is not a list of {} numbers", where(t, row),
                           key, n);
  }
  for (double x : out) {
    if (!std::isfinite(x))
      throw_error<DataError>("nuScenes: {} field '{}' holds a non-finite number", where(t, row),
                             key);
  }
  return out;
}

geom::Pose pose_of(const Table& t, const json& row) {
  const auto tr = nums(t, row, "translation", 3);
  const auto q = nums(t, row, "rotation", 4);
  if (!(q[0] * q[0] + q[1] * q[1] + q[2] * q[2] + q[3] * q[3] > 1e-12))
    throw_error<DataError>("nuScenes: {} field 'rotation' is a zero quaternion", where(t, row));
  return {quat_to_mat(q[0], q[1], q[2], q[3]), {tr[0], tr[1], tr[2]}};
}

Table load_table(const std::string& dir, const std::string& name, bool required = true) {
  Table t;
  t.name = name;
  t.file = join_path(dir, name + ".json");
  std::ifstream f(t.file, std::ios::binary);
  if (!f) {
    if (!required) return t;
    throw_error<DataError>("nuScenes: table '{}' is missing (expected '{}')", name, t.file);
  }
  try {
    t.rows = json::parse(f);
  } catch (const json::exception& e) {
    throw_error<DataError>("nuScenes: table '{}' is not valid JSON: {}", t.file, e.what());
  }
  if (!t.rows.is_array()) throw_error<DataError>("nuScenes: table '{}' is not a JSON list", t.file);
  t.by_token.reserve(t.rows.size());
  for (const auto& row : t.rows) {
    const auto it = row.find("token");
    if (!row.is_object() || it == row.end() || !it->is_string())
      throw_error<DataError>("nuScenes: table '{}' holds a record without a string 'token'",
                             t.file);
    if (!t.by_token.emplace(it->get<std::string>(), &row).second)
      throw_error<DataError>("nuScenes: table '{}' holds token '{}' twice", t.file,
                             it->get<std::string>());
  }
  return t;
}

// {key: value} or {key: [values]} from a YAML or JSON file.
YAML::Node load_yaml_map(const std::string& path, const std::string& flag) {
  YAML::Node n;
  try {
    n = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    throw_error<UsageError>("convert: {} '{}' cannot be read", flag, path);
  } catch (const YAML::Exception& e) {
    throw_error<UsageError>("convert: {} '{}' is not valid YAML/JSON: {}", flag, path, e.what());
  }
  if (!n.IsMap()) throw_error<UsageError>("convert: {} '{}' must hold a mapping", flag, path);
  return n;
}

// ---- Conversion -----------------------------------------------------------------------------

// ---- Map expansion layers (maps/expansion/<location>.json, v1.3) -------------------------------

using Pt = std::array<double, 2>;
struct MapShape {
  std::vector<std::vector<Pt> > rings;  // polygon: the exterior, then the holes; line: one ring
  double x0 = 1e300, y0 = 1e300, x1 = -1e300, y1 = -1e300;  // global bounding box
};
// The BEV map classes, painted in this order (later over earlier), before the objects.
enum MapLayer { kWalkway = 0, kDrivable, kCrossing, kDivider, kMapLayers };
// Class index (in bev_classes) of each layer: background 0, then drivable_area, ped_crossing,
// walkway, divider.
const uint8_t kMapClass[kMapLayers] = {3, 1, 2, 4};

struct NuMap {
  std::array<std::vector<MapShape>, kMapLayers> layers;
};

NuMap load_map(const std::string& file) {
  std::ifstream f(file, std::ios::binary);
  if (!f) throw_error<DataError>("nuScenes: map expansion file '{}' is missing", file);
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    throw_error<DataError>("nuScenes: map expansion file '{}' is not valid JSON: {}", file,
                           e.what());
  }
  auto list = [&](const char* key) -> const json& {
    const auto it = j.find(key);
    if (it == j.end() || !it->is_array())
      throw_error<DataError>("nuScenes: map expansion file '{}' has no list '{}'", file, key);
    return *it;
  };
  auto text = [&](const json& r, const char* key, const char* layer) {
    const auto it = r.find(key);
    if (it == r.end() || !it->is_string())
      throw_error<DataError>("nuScenes: map '{}' layer '{}': a record without a string '{}'", file,
                             layer, key);
    return it->get<std::string>();
  };
  std::unordered_map<std::string, Pt> nodes;
  for (const auto& n : list("node")) {
    const auto x = n.find("x"), y = n.find("y");
    if (x == n.end() || y == n.end() || !x->is_number() || !y->is_number())
      throw_error<DataError>("nuScenes: map '{}': node '{}' has no numeric x and y", file,
                             text(n, "token", "node"));
    nodes[text(n, "token", "node")] = {x->get<double>(), y->get<double>()};
  }
  auto ring = [&](const json& tokens, const std::string& what) {
    std::vector<Pt> out;
    if (!tokens.is_array())
      throw_error<DataError>("nuScenes: map '{}': {} has no node list", file, what);
    for (const auto& t : tokens) {
      const auto it = t.is_string() ? nodes.find(t.get<std::string>()) : nodes.end();
      if (it == nodes.end())
        throw_error<DataError>("nuScenes: map '{}': {} points to a node that is not there", file,
                               what);
      out.push_back(it->second);
    }
    return out;
  };
  std::unordered_map<std::string, MapShape> polygons, lines;
  auto bound = [](MapShape& s) {
    for (const auto& r : s.rings) {
      for (const Pt& p : r) {
        s.x0 = std::min(s.x0, p[0]), s.y0 = std::min(s.y0, p[1]);
        s.x1 = std::max(s.x1, p[0]), s.y1 = std::max(s.y1, p[1]);
      }
    }
  };
  for (const auto& p : list("polygon")) {
    const std::string tok = text(p, "token", "polygon");
    MapShape s;
    s.rings.push_back(ring(p.value("exterior_node_tokens", json()), "polygon '" + tok + "'"));
    for (const auto& h : p.value("holes", json::array()))
      s.rings.push_back(ring(h.value("node_tokens", json()), "a hole of polygon '" + tok + "'"));
    bound(s);
    polygons[tok] = std::move(s);
  }
  for (const auto& l : list("line")) {
    const std::string tok = text(l, "token", "line");
    MapShape s;
    s.rings.push_back(ring(l.value("node_tokens", json()), "line '" + tok + "'"));
    bound(s);
    lines[tok] = std::move(s);
  }
  auto polygon = [&](const std::string& tok, const char* layer) -> const MapShape& {
    const auto it = polygons.find(tok);
    if (it == polygons.end())
      throw_error<DataError>(
          "nuScenes: map '{}' layer '{}' points to polygon '{}', which is not "
          "there",
          file, layer, tok);
    return it->second;
  };
  NuMap m;
  for (const auto& r : list("drivable_area")) {
    for (const auto& t : r.value("polygon_tokens", json::array()))
      m.layers[kDrivable].push_back(polygon(t.get<std::string>(), "drivable_area"));
  }
  for (const auto& r : list("ped_crossing"))
    m.layers[kCrossing].push_back(
        polygon(text(r, "polygon_token", "ped_crossing"), "ped_crossing"));
  for (const auto& r : list("walkway"))
    m.layers[kWalkway].push_back(polygon(text(r, "polygon_token", "walkway"), "walkway"));
  for (const char* layer : {"lane_divider", "road_divider"}) {
    for (const auto& r : list(layer)) {
      const auto it = lines.find(text(r, "line_token", layer));
      if (it == lines.end())
        throw_error<DataError>("nuScenes: map '{}' layer '{}' points to a line that is not there",
                               file, layer);
      m.layers[kDivider].push_back(it->second);
    }
  }
  return m;
}

// Even-odd rule over all rings (exterior and holes).
bool inside(const std::vector<std::vector<Pt> >& rings, double x, double y) {
  bool in = false;
  for (const auto& r : rings) {
    for (size_t i = 0, k = r.size() - 1; i < r.size(); k = i++) {
      if (((r[i][1] > y) != (r[k][1] > y)) &&
          (x < (r[k][0] - r[i][0]) * (y - r[i][1]) / (r[k][1] - r[i][1]) + r[i][0]))
        in = !in;
    }
  }
  return in;
}

double segment_distance(const Pt& a, const Pt& b, double x, double y) {
  const double dx = b[0] - a[0], dy = b[1] - a[1];
  const double len2 = dx * dx + dy * dy;
  double t = len2 > 0 ? ((x - a[0]) * dx + (y - a[1]) * dy) / len2 : 0.0;
  t = std::clamp(t, 0.0, 1.0);
  return std::hypot(a[0] + t * dx - x, a[1] + t * dy - y);
}

struct Job {
  std::string split;
  int64_t index = 0;  // within the split
  const json* sample = nullptr;
};

struct Converter {
  NuScenesConvertOptions o;
  std::string dir;  // dataroot/version
  Table sample, sample_data, ego_pose, calibrated_sensor, sensor, annotation, instance, category,
      scene, log, visibility;
  std::unordered_map<std::string, std::map<std::string, const json*> > keyframes;  // sample -> ch
  std::unordered_map<std::string, std::vector<const json*> > anns;                 // sample -> anns
  std::map<std::string, std::string> category_class;
  std::map<std::string, int64_t> class_index;
  std::vector<std::string> classes;
  int64_t height = 0, width = 0, stored_h = 0, stored_w = 0;
  bool passthrough = false;
  // Map expansion layers by log location (empty: boxes only).
  std::map<std::string, NuMap> maps;
  uint8_t object_offset = 1;  // bev class of box class c: c + object_offset

  const NuMap* map_of(const json& s) const {
    if (maps.empty()) return nullptr;
    const json& sc = scene.at(str(sample, s, "scene_token"), where(sample, s));
    const json& lg = log.at(str(scene, sc, "log_token"), where(scene, sc));
    return &maps.at(str(log, lg, "location"));
  }

  // The map layers into `bev` (before the objects): the grid's cell centres taken to the global
  // frame by the reference pose's yaw and position (the maps are 2-D).
  void paint_map(const NuMap& map, const geom::Pose& ref, at::Tensor& bev) const {
    const BevGrid& g = o.bev;
    const int64_t X = g.x_cells(), Y = g.y_cells();
    uint8_t* p = bev.data_ptr<uint8_t>();
    const double yaw = std::atan2(ref.R.m[1][0], ref.R.m[0][0]);
    const double c = std::cos(yaw), s = std::sin(yaw);
    auto to_global = [&](double x, double y) -> Pt {
      x += o.ego_x_offset;
      return {c * x - s * y + ref.t.x, s * x + c * y + ref.t.y};
    };
    auto to_ego = [&](const Pt& q) -> Pt {
      const double dx = q[0] - ref.t.x, dy = q[1] - ref.t.y;
      return {c * dx + s * dy - o.ego_x_offset, -s * dx + c * dy};
    };
    // The grid's global bounding box, to skip shapes far away.
    double gx0 = 1e300, gy0 = 1e300, gx1 = -1e300, gy1 = -1e300;
    for (double x : {g.x_min, g.x_max}) {
      for (double y : {g.y_min, g.y_max}) {
        const Pt q = to_global(x, y);
        gx0 = std::min(gx0, q[0]), gy0 = std::min(gy0, q[1]);
        gx1 = std::max(gx1, q[0]), gy1 = std::max(gy1, q[1]);
      }
    }
    const double half = 0.5 * g.resolution;
    for (int layer = 0; layer < kMapLayers; ++layer) {
      for (const MapShape& sh : map.layers[static_cast<size_t>(layer)]) {
        if (sh.x1 < gx0 - half || sh.x0 > gx1 + half || sh.y1 < gy0 - half || sh.y0 > gy1 + half)
          continue;
        std::vector<std::vector<Pt> > rings;
        double ex0 = 1e300, ey0 = 1e300, ex1 = -1e300, ey1 = -1e300;
        for (const auto& r : sh.rings) {
          rings.emplace_back();
          for (const Pt& q : r) {
            const Pt e = to_ego(q);
            rings.back().push_back(e);
            ex0 = std::min(ex0, e[0]), ey0 = std::min(ey0, e[1]);
            ex1 = std::max(ex1, e[0]), ey1 = std::max(ey1, e[1]);
          }
        }
        const bool line = layer == kDivider;
        const double m = line ? half : 0.0;
        const auto ix0 = std::max<int64_t>(
            0, static_cast<int64_t>(std::floor((ex0 - m - g.x_min) / g.resolution)));
        const auto ix1 = std::min<int64_t>(
            X - 1, static_cast<int64_t>(std::floor((ex1 + m - g.x_min) / g.resolution)));
        const auto iy0 = std::max<int64_t>(
            0, static_cast<int64_t>(std::floor((ey0 - m - g.y_min) / g.resolution)));
        const auto iy1 = std::min<int64_t>(
            Y - 1, static_cast<int64_t>(std::floor((ey1 + m - g.y_min) / g.resolution)));
        for (int64_t ix = ix0; ix <= ix1; ++ix) {
          const double x = g.x_min + (static_cast<double>(ix) + 0.5) * g.resolution;
          for (int64_t iy = iy0; iy <= iy1; ++iy) {
            const double y = g.y_min + (static_cast<double>(iy) + 0.5) * g.resolution;
            bool hit = false;
            if (line) {
              // A divider: the cells whose centre lies within half a cell of it.
              const auto& r = rings.front();
              for (size_t i = 0; !hit && i + 1 < r.size(); ++i)
                hit = segment_distance(r[i], r[i + 1], x, y) <= half;
            } else {
              hit = inside(rings, x, y);
            }
            if (hit) p[ix * Y + iy] = kMapClass[layer];
          }
        }
      }
    }
  }

  // Counted across worker threads: boxes ignored by category.
  std::mutex m;
  std::map<std::string, int64_t> ignored;
  int64_t boxes = 0;

  std::string channel_of(const json& sd) const {
    const json& cs = calibrated_sensor.at(str(sample_data, sd, "calibrated_sensor_token"),
                                          where(sample_data, sd));
    const json& se =
        sensor.at(str(calibrated_sensor, cs, "sensor_token"), where(calibrated_sensor, cs));
    return str(sensor, se, "channel");
  }

  void index() {
    for (const auto& sd : sample_data.rows) {
      const json& kf = field(sample_data, sd, "is_key_frame");
      if (!kf.is_boolean() || !kf.get<bool>()) continue;
      const std::string s = str(sample_data, sd, "sample_token");
      sample.at(s, where(sample_data, sd));
      keyframes[s][channel_of(sd)] = &sd;
    }
    for (const auto& a : annotation.rows) {
      const std::string s = str(annotation, a, "sample_token");
      sample.at(s, where(annotation, a));
      anns[s].push_back(&a);
    }
  }

  double timestamp_s(const json& ann) const {
    const json& s = sample.at(str(annotation, ann, "sample_token"), where(annotation, ann));
    return num(sample, s, "timestamp") * 1e-6;
  }

  // The devkit's box velocity (global frame): the centre difference between the previous and the
  // next annotation of the instance over their time difference (or between this one and the one
  // neighbour there is); NaN without a neighbour or over more than 1.5 s (3 s with both).
  std::array<double, 2> velocity(const json& a) const {
    const std::string prev = str(annotation, a, "prev"), next = str(annotation, a, "next");
    const json* first = &a;
    const json* last = &a;
    if (!prev.empty()) first = &annotation.at(prev, where(annotation, a));
    if (!next.empty()) last = &annotation.at(next, where(annotation, a));
    const double nan = std::numeric_limits<double>::quiet_NaN();
    if (first == last) return {nan, nan};
    const auto p0 = nums(annotation, *first, "translation", 3);
    const auto p1 = nums(annotation, *last, "translation", 3);
    const double dt = timestamp_s(*last) - timestamp_s(*first);
    const double max_dt = (!prev.empty() && !next.empty()) ? 3.0 : 1.5;
    if (!(dt > 0) || dt > max_dt) return {nan, nan};
    return {(p1[0] - p0[0]) / dt, (p1[1] - p0[1]) / dt};
  }

  double visibility_of(const json& a) const {
    // nuScenes' visibility levels are bins of the fraction visible in the 6 images (1: 0-40 %,
    // 2: 40-60 %, 3: 60-80 %, 4: 80-100 %); a box is stored at its bin's middle. A box with no
    // lidar or radar point is 0 (the detection benchmark drops those from its ground truth).
    const auto l = a.find("num_lidar_pts"), r = a.find("num_radar_pts");
    if (l != a.end() && r != a.end() && l->is_number() && r->is_number() &&
        l->get<double>() + r->get<double>() <= 0)
      return 0.0;
    const auto v = a.find("visibility_token");
    if (v == a.end() || !v->is_string() || v->get<std::string>().empty()) return 1.0;
    static const std::map<std::string, double> kMid = {
        {"1", 0.2}, {"2", 0.5}, {"3", 0.7}, {"4", 0.9}};
    const auto it = kMid.find(v->get<std::string>());
    return it == kMid.end() ? 1.0 : it->second;
  }

  std::vector<uint8_t> read_file(const std::string& path, const std::string& what) const {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw_error<DataError>("nuScenes: {}: image '{}' is missing", what, path);
    std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)),
                               std::istreambuf_iterator<char>());
    if (bytes.empty()) throw_error<DataError>("nuScenes: {}: image '{}' is empty", what, path);
    return bytes;
  }

  SceneRecord make(const Job& job) {
    const json& s = *job.sample;
    const std::string token = str(sample, s, "token");
    const auto kf_it = keyframes.find(token);
    const std::map<std::string, const json*> none;
    const auto& kf = kf_it == keyframes.end() ? none : kf_it->second;
    auto sd_of = [&](const std::string& ch) -> const json* {
      const auto it = kf.find(ch);
      return it == kf.end() ? nullptr : it->second;
    };
    auto ego_of = [&](const json& sd) {
      return pose_of(ego_pose,
                     ego_pose.at(str(sample_data, sd, "ego_pose_token"), where(sample_data, sd)));
    };
    const json* ref_sd = sd_of("LIDAR_TOP");
    for (const auto& ch : o.cameras) {
      if (!sd_of(ch)) {
        throw_error<DataError>(
            "nuScenes: sample '{}' has no keyframe sample_data for camera {} "
            "(in '{}')",
            token, ch, sample_data.file);
      }
    }
    if (!ref_sd) ref_sd = sd_of(o.cameras.front());
    const geom::Pose ref = ego_of(*ref_sd);
    const geom::Pose global_to_ref = inverse(ref);
    const geom::Vec3 shift{o.ego_x_offset, 0, 0};

    SceneRecord r;
    r.sample_token = token;
    {
      // The stored ego frame in the global frame: the reference pose after the origin shift.
      geom::Pose e = ref;
      e.t = ref.apply(shift);
      r.ego_to_global = at::eye(4, at::kDouble);
      double* T = r.ego_to_global.data_ptr<double>();
      for (int i = 0; i < 3; ++i) {
        for (int j = 0; j < 3; ++j) T[i * 4 + j] = e.R.m[i][j];
      }
      T[3] = e.t.x, T[7] = e.t.y, T[11] = e.t.z;
    }
    const auto n = static_cast<int64_t>(o.cameras.size());
    r.intrinsics = at::empty({n, 3, 3}, at::kFloat);
    r.cam_to_ego = at::empty({n, 4, 4}, at::kFloat);
    if (!passthrough) r.images = at::empty({n, height, width, 3}, at::kByte);
    for (int64_t c = 0; c < n; ++c) {
      const std::string& ch = o.cameras[static_cast<size_t>(c)];
      const json& sd = *sd_of(ch);
      const std::string what = fmt::format("sample '{}' camera {} (sample_data '{}')", token, ch,
                                           str(sample_data, sd, "token"));
      const json& cs = calibrated_sensor.at(str(sample_data, sd, "calibrated_sensor_token"),
                                            where(sample_data, sd));
      // camera -> ego at the camera's time -> global -> the reference ego frame.
      geom::Pose cam_to_ref =
          compose(global_to_ref, compose(ego_of(sd), pose_of(calibrated_sensor, cs)));
      cam_to_ref.t = cam_to_ref.t - shift;
      const json& kj = field(calibrated_sensor, cs, "camera_intrinsic");
      std::array<double, 9> k{};
      bool ok = kj.is_array() && kj.size() == 3;
      for (size_t i = 0; ok && i < 3; ++i) {
        ok = kj[i].is_array() && kj[i].size() == 3;
        for (size_t j = 0; ok && j < 3; ++j) {
          ok = kj[i][j].is_number();
          if (ok) k[i * 3 + j] = kj[i][j].get<double>();
        }
      }
      if (!ok || !(k[0] > 0) || !(k[4] > 0)) {
        throw_error<DataError>("nuScenes: {} field 'camera_intrinsic' is not a 3 x 3 camera matrix",
                               where(calibrated_sensor, cs));
      }
      const std::string file = join_path(o.dataroot, str(sample_data, sd, "filename"));
      std::vector<uint8_t> bytes = read_file(file, what);
      const std::string ctx = fmt::format("nuScenes: {}: image '{}'", what, file);
      const JpegSize js = jpeg_size(bytes.data(), bytes.size(), ctx);
      if (js.height != stored_h || js.width != stored_w) {
        throw_error<DataError>("{} is {} x {}, the first camera's {} x {}", ctx, js.height,
                               js.width, stored_h, stored_w);
      }
      // The scale from the stored image to the written one, per axis (exact: pixel edges map to
      // pixel edges, docs/data.md's convention), applied to the intrinsics' first two rows.
      const double sx = static_cast<double>(width) / static_cast<double>(stored_w);
      const double sy = static_cast<double>(height) / static_cast<double>(stored_h);
      if (passthrough) {
        // Decoded at 1/8 (cheap) to find a corrupt or truncated file now, not at training.
        decode_jpeg(bytes.data(), bytes.size(), 8, ctx);
        r.jpeg.push_back(std::move(bytes));
      } else {
        int scale = 8;
        while (scale > 1 &&
               ((stored_h + scale - 1) / scale < height || (stored_w + scale - 1) / scale < width))
          scale /= 2;
        at::Tensor img = decode_jpeg(bytes.data(), bytes.size(), scale, ctx);
        if (img.size(0) != height || img.size(1) != width) {
          // The decoded grid's pixel covers `scale` stored pixels; the resize maps stored
          // coordinates u to sx u, so from the decoded grid by sx * scale.
          at::Tensor f = img.permute({2, 0, 1}).unsqueeze(0).to(at::kFloat);
          f = at::_upsample_bilinear2d_aa(f, {height, width}, false, sy * scale, sx * scale);
          img = f.squeeze(0).permute({1, 2, 0}).round().clamp(0, 255).to(at::kByte);
        }
        r.images[c].copy_(img);
      }
      float* K = r.intrinsics.data_ptr<float>() + c * 9;
      for (int j = 0; j < 3; ++j) {
        K[j] = static_cast<float>(k[j] * sx);
        K[3 + j] = static_cast<float>(k[3 + j] * sy);
        K[6 + j] = static_cast<float>(k[6 + j]);
      }
      const at::Tensor T = geom::pose_tensor(cam_to_ref);
      std::copy_n(T.data_ptr<float>(), 16, r.cam_to_ego.data_ptr<float>() + c * 16);
    }

    // Boxes: global -> the reference ego frame.
    std::vector<float> rows, vel;
    std::map<std::string, int64_t> skipped;
    const auto a_it = anns.find(token);
    if (a_it != anns.end()) {
      for (const json* ap : a_it->second) {
        const json& a = *ap;
        const json& inst = instance.at(str(annotation, a, "instance_token"), where(annotation, a));
        const json& cat = category.at(str(instance, inst, "category_token"), where(instance, inst));
        const std::string cname = str(category, cat, "name");
        const auto cls = category_class.find(cname);
        if (cls == category_class.end()) {
          ++skipped[cname];
          continue;
        }
        const geom::Pose box = pose_of(annotation, a);
        const auto size = nums(annotation, a, "size", 3);  // w, l, h
        const geom::Vec3 c = global_to_ref.apply(box.t) - shift;
        const geom::Mat3 rot = global_to_ref.R * box.R;
        const double yaw = std::atan2(rot.m[1][0], rot.m[0][0]);
        const auto v = velocity(a);
        const geom::Vec3 vr = global_to_ref.R * geom::Vec3{v[0], v[1], 0};
        rows.insert(
            rows.end(),
            {static_cast<float>(c.x), static_cast<float>(c.y), static_cast<float>(c.z),
             static_cast<float>(size[1]), static_cast<float>(size[0]), static_cast<float>(size[2]),
             static_cast<float>(yaw), static_cast<float>(class_index.at(cls->second)),
             static_cast<float>(visibility_of(a))});
        vel.insert(vel.end(), {static_cast<float>(std::isnan(v[0]) ? v[0] : vr.x),
                               static_cast<float>(std::isnan(v[1]) ? v[1] : vr.y)});
      }
    }
    const auto k = static_cast<int64_t>(rows.size() / kBoxColumns);
    r.boxes = at::empty({k, kBoxColumns}, at::kFloat);
    std::copy(rows.begin(), rows.end(), r.boxes.data_ptr<float>());
    r.velocities = at::empty({k, 2}, at::kFloat);
    std::copy(vel.begin(), vel.end(), r.velocities.data_ptr<float>());
    r.bev_semantics = at::zeros({o.bev.x_cells(), o.bev.y_cells()}, at::kByte);
    if (const NuMap* map = map_of(s)) paint_map(*map, ref, r.bev_semantics);
    rasterise(r.boxes, r.bev_semantics);
    {
      std::lock_guard<std::mutex> lock(m);
      for (const auto& [name, count] : skipped) ignored[name] += count;
      boxes += k;
    }
    return r;
  }

  // BEV labels from the boxes' footprints (docs/data.md's rule for objects), over the map layers:
  // a cell takes the class (index + object_offset) of a box whose footprint holds the cell's
  // centre or that holds the box's centre.
  void rasterise(const at::Tensor& boxes, at::Tensor& bev) const {
    const BevGrid& g = o.bev;
    const int64_t X = g.x_cells(), Y = g.y_cells();
    uint8_t* p = bev.data_ptr<uint8_t>();
    const float* b = boxes.data_ptr<float>();
    for (int64_t i = 0; i < boxes.size(0); ++i) {
      const float* row = b + i * kBoxColumns;
      geom::Box box;
      box.x = row[kBoxX], box.y = row[kBoxY], box.z = row[kBoxZ];
      box.l = row[kBoxL], box.w = row[kBoxW], box.h = row[kBoxH], box.yaw = row[kBoxYaw];
      const auto cls = static_cast<uint8_t>(row[kBoxClass] + object_offset);
      const double reach = 0.5 * std::hypot(box.l, box.w);
      const auto lo_x = std::max<int64_t>(
          0, static_cast<int64_t>(std::floor((box.x - reach - g.x_min) / g.resolution)));
      const auto hi_x = std::min<int64_t>(
          X - 1, static_cast<int64_t>(std::floor((box.x + reach - g.x_min) / g.resolution)));
      const auto lo_y = std::max<int64_t>(
          0, static_cast<int64_t>(std::floor((box.y - reach - g.y_min) / g.resolution)));
      const auto hi_y = std::min<int64_t>(
          Y - 1, static_cast<int64_t>(std::floor((box.y + reach - g.y_min) / g.resolution)));
      for (int64_t ix = lo_x; ix <= hi_x; ++ix) {
        for (int64_t iy = lo_y; iy <= hi_y; ++iy) {
          const double cx = g.x_min + (static_cast<double>(ix) + 0.5) * g.resolution;
          const double cy = g.y_min + (static_cast<double>(iy) + 0.5) * g.resolution;
          if (box.footprint_contains(cx, cy)) p[ix * Y + iy] = cls;
        }
      }
      const double fx = std::floor((box.x - g.x_min) / g.resolution);
      const double fy = std::floor((box.y - g.y_min) / g.resolution);
      if (fx >= 0 && fy >= 0 && fx < static_cast<double>(X) && fy < static_cast<double>(Y))
        p[static_cast<int64_t>(fx) * Y + static_cast<int64_t>(fy)] = cls;
    }
  }
};

void check_convert_options(const NuScenesConvertOptions& o) {
  auto bad = [](const std::string& what) { throw UsageError("convert nuscenes: " + what); };
  if (o.dataroot.empty()) bad("--dataroot DIR is required");
  if (o.out.empty()) bad("--out DIR is required");
  if (o.image_codec != "jpeg" && o.image_codec != "raw")
    bad(fmt::format("--image-codec must be jpeg or raw, got '{}'", o.image_codec));
  if (o.quality < 1 || o.quality > 100)
    bad(fmt::format("--quality must be in 1..100, got {}", o.quality));
  if (o.height < 0 || o.width < 0 || (o.height == 0) != (o.width == 0))
    bad("--image-size needs a height and a width >= 8 (or neither)");
  if (o.shard_scenes < 1) bad("--shard-scenes must be >= 1");
  if (o.workers < 0) bad("--workers must be >= 0");
  if (!std::isfinite(o.ego_x_offset) || std::abs(o.ego_x_offset) > 10)
    bad(fmt::format("--ego-x-offset must be within +-10 m, got {}", o.ego_x_offset));
  const auto& g = o.bev;
  if (!(g.resolution > 0) || !(g.x_max > g.x_min) || !(g.y_max > g.y_min))
    bad("the BEV grid is empty");
  if (!jpeg_available())
    bad("this build has no JPEG codec (libjpeg-turbo was not found when it was built; install "
        "libturbojpeg0-dev and rebuild)");
}

// The options that decide the shards' contents, as recorded in convert.json.
std::string options_record(const NuScenesConvertOptions& o, const std::string& classes_text,
                           const std::string& splits_text, int64_t h, int64_t w) {
  json j;
  j["dataroot"] = fs::weakly_canonical(o.dataroot).string();
  j["version"] = o.version;
  j["cameras"] = o.cameras;
  j["image_size"] = {h, w};
  j["image_codec"] = o.image_codec;
  j["quality"] = o.quality;
  j["classes"] = classes_text;
  j["splits"] = splits_text;
  j["ego_x_offset"] = o.ego_x_offset;
  j["bev"] = {o.bev.x_min, o.bev.x_max, o.bev.y_min, o.bev.y_max, o.bev.resolution};
  j["shard_scenes"] = o.shard_scenes;
  j["compression"] = o.compression;
  j["maps"] = fs::is_directory(fs::path(o.dataroot) / "maps" / "expansion");
  return j.dump(2) + "\n";
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_text_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f) {
      std::error_code ec;
      fs::remove(tmp, ec);
      throw_error<IoError>("cannot write '{}' (disk full?)", tmp);
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw_error<IoError>("cannot rename '{}' to '{}': {}", tmp, path, ec.message());
}

}  // namespace

NuScenesConvertSummary convert_nuscenes(const NuScenesConvertOptions& opts) {
  Converter cv;
  cv.o = opts;
  NuScenesConvertOptions& o = cv.o;
  if (o.cameras.empty()) o.cameras = nuscenes_cameras();
  check_convert_options(o);
  const std::set<std::string> unique(o.cameras.begin(), o.cameras.end());
  if (unique.size() != o.cameras.size())
    throw_error<UsageError>("convert nuscenes: --cameras lists a camera twice");

  // The version folder.
  cv.dir = join_path(o.dataroot, o.version);
  if (!fs::is_directory(o.dataroot))
    throw_error<DataError>("nuScenes: --dataroot '{}' is not a folder", o.dataroot);
  if (!fs::is_directory(cv.dir)) {
    std::vector<std::string> found;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(o.dataroot, ec)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.rfind("v1.0-", 0) == 0) found.push_back(n);
    }
    std::sort(found.begin(), found.end());
    throw_error<DataError>("nuScenes: '{}' has no version folder '{}'{}", o.dataroot, o.version,
                           found.empty() ? std::string(" (and no v1.0-* folder at all)")
                                         : fmt::format("; it holds {}", core::join(found, ", ")));
  }

  // Classes.
  std::string classes_text;
  if (o.classes_file.empty()) {
    cv.category_class = nuscenes_default_category_map();
    cv.classes = nuscenes_detection_classes();
  } else {
    const YAML::Node n = load_yaml_map(o.classes_file, "--classes");
    classes_text = read_text(o.classes_file);
    for (const auto& kv : n) {
      if (!kv.second.IsScalar())
        throw_error<UsageError>("convert: --classes '{}': '{}' must map to a class name",
                                o.classes_file, kv.first.as<std::string>());
      const std::string cls = kv.second.as<std::string>();
      cv.category_class[kv.first.as<std::string>()] = cls;
      if (std::find(cv.classes.begin(), cv.classes.end(), cls) == cv.classes.end())
        cv.classes.push_back(cls);
    }
    if (cv.classes.empty())
      throw_error<UsageError>("convert: --classes '{}' maps no category", o.classes_file);
  }
  if (cv.classes.size() > 250)
    throw_error<UsageError>("convert: {} classes; at most 250 (BEV labels are uint8)",
                            cv.classes.size());
  for (size_t i = 0; i < cv.classes.size(); ++i)
    cv.class_index[cv.classes[i]] = static_cast<int64_t>(i);

  core::Stopwatch clock;
  cv.sample = load_table(cv.dir, "sample");
  cv.sample_data = load_table(cv.dir, "sample_data");
  cv.ego_pose = load_table(cv.dir, "ego_pose");
  cv.calibrated_sensor = load_table(cv.dir, "calibrated_sensor");
  cv.sensor = load_table(cv.dir, "sensor");
  cv.annotation = load_table(cv.dir, "sample_annotation");
  cv.instance = load_table(cv.dir, "instance");
  cv.category = load_table(cv.dir, "category");
  cv.scene = load_table(cv.dir, "scene");
  cv.log = load_table(cv.dir, "log");
  cv.index();
  // Map expansion layers, when the folder is there: one file per log location.
  const std::string expansion = join_path(join_path(o.dataroot, "maps"), "expansion");
  if (fs::is_directory(expansion)) {
    for (const auto& lg : cv.log.rows) {
      const std::string loc = str(cv.log, lg, "location");
      if (!cv.maps.count(loc)) cv.maps[loc] = load_map(join_path(expansion, loc + ".json"));
    }
    cv.object_offset = static_cast<uint8_t>(1 + kMapLayers);
    core::log::info("convert nuscenes: map expansion layers of {} location(s) from '{}'",
                    cv.maps.size(), expansion);
  } else {
    core::log::info("convert nuscenes: no '{}': BEV labels from the boxes' footprints alone",
                    expansion);
  }
  core::log::info(
      "convert nuscenes: {} tables read in {:.1f} s: {} scenes, {} samples, {} sample_data, {} "
      "annotations",
      o.version, clock.elapsed_s(), cv.scene.rows.size(), cv.sample.rows.size(),
      cv.sample_data.rows.size(), cv.annotation.rows.size());

  // Splits: scene name -> split.
  std::map<std::string, std::string> split_of;
  std::string splits_text;
  if (!o.splits_file.empty()) {
    const YAML::Node n = load_yaml_map(o.splits_file, "--splits");
    splits_text = read_text(o.splits_file);
    for (const auto& kv : n) {
      const std::string split = kv.first.as<std::string>();
      if (!std::regex_match(split, std::regex("[A-Za-z0-9_-]{1,32}")))
        throw_error<UsageError>(
            "convert: --splits '{}': split name '{}' (letters, digits, _ and -)", o.splits_file,
            split);
      if (!kv.second.IsSequence())
        throw_error<UsageError>("convert: --splits '{}': '{}' must list scene names", o.splits_file,
                                split);
      for (const auto& s : kv.second) {
        const std::string name = s.as<std::string>();
        if (!split_of.emplace(name, split).second)
          throw_error<UsageError>("convert: --splits '{}': scene '{}' is in two splits",
                                  o.splits_file, name);
      }
    }
  }
  const std::string default_split = o.version == "v1.0-test" ? "test" : "train";

  // Jobs: scenes by name, each scene's samples in order.
  std::vector<const json*> scenes;
  for (const auto& s : cv.scene.rows) scenes.push_back(&s);
  std::sort(scenes.begin(), scenes.end(), [&](const json* a, const json* b) {
    return str(cv.scene, *a, "name") < str(cv.scene, *b, "name");
  });
  std::map<std::string, std::vector<const json*> > by_split;
  int64_t unlisted = 0;
  for (const json* sc : scenes) {
    const std::string name = str(cv.scene, *sc, "name");
    std::string split = default_split;
    if (!o.splits_file.empty()) {
      const auto it = split_of.find(name);
      if (it == split_of.end()) {
        ++unlisted;
        continue;
      }
      split = it->second;
    }
    std::string tok = str(cv.scene, *sc, "first_sample_token");
    std::set<std::string> seen;
    while (!tok.empty()) {
      if (!seen.insert(tok).second)
        throw_error<DataError>(
            "nuScenes: scene '{}': its samples' 'next' tokens form a loop at '{}'", name, tok);
      const json& s = cv.sample.at(tok, fmt::format("'{}' scene '{}'", cv.scene.file, name));
      by_split[split].push_back(&s);
      tok = str(cv.sample, s, "next");
    }
  }
  if (unlisted > 0)
    core::log::warn("convert nuscenes: {} scene(s) in no split of '{}' are not converted", unlisted,
                    o.splits_file);
  if (o.splits_file.empty()) {
    core::log::warn(
        "convert nuscenes: no --splits: every scene goes to split '{}' (docs/data.md: "
        "tools/nuscenes_splits.py writes the official train/val split file)",
        default_split);
  }
  std::vector<Job> jobs;
  for (const auto& [split, samples] : by_split) {
    for (size_t i = 0; i < samples.size(); ++i)
      jobs.push_back({split, static_cast<int64_t>(i), samples[i]});
  }
  if (jobs.empty()) throw_error<DataError>("nuScenes: '{}' holds no sample to convert", cv.dir);

  // The stored image size: the first job's first camera.
  {
    Job& j = jobs.front();
    const std::string tok = str(cv.sample, *j.sample, "token");
    const auto& kf = cv.keyframes[tok];
    const auto it = kf.find(o.cameras.front());
    if (it == kf.end())
      throw_error<DataError>("nuScenes: sample '{}' has no keyframe sample_data for camera {}", tok,
                             o.cameras.front());
    const std::string file = join_path(o.dataroot, str(cv.sample_data, *it->second, "filename"));
    const auto bytes =
        cv.read_file(file, fmt::format("sample '{}' camera {}", tok, o.cameras.front()));
    const JpegSize js =
        jpeg_size(bytes.data(), bytes.size(), fmt::format("nuScenes: image '{}'", file));
    cv.stored_h = js.height;
    cv.stored_w = js.width;
  }
  cv.height = o.height ? o.height : cv.stored_h;
  cv.width = o.width ? o.width : cv.stored_w;
  if (cv.height > cv.stored_h || cv.width > cv.stored_w || cv.height < 8 || cv.width < 8) {
    throw_error<UsageError>(
        "convert nuscenes: --image-size {} {}: the images are {} x {}; the "
        "size must be 8 or more and at most that (no upscaling)",
        cv.height, cv.width, cv.stored_h, cv.stored_w);
  }
  cv.passthrough = o.image_codec == "jpeg" && cv.height == cv.stored_h && cv.width == cv.stored_w;

  // The output folder, and what an earlier run with the same options left.
  std::error_code ec;
  fs::create_directories(o.out, ec);
  if (ec) throw_error<IoError>("cannot create output folder '{}': {}", o.out, ec.message());
  const std::string record = options_record(o, classes_text, splits_text, cv.height, cv.width);
  const std::string record_path = join_path(o.out, "convert.json");
  if (o.overwrite) {
    fs::remove(join_path(o.out, "dataset.json"), ec);
    fs::remove(record_path, ec);
    const std::regex shard_re(R"([A-Za-z0-9_-]+_\d{5}\.h5)");
    for (const auto& e : fs::directory_iterator(o.out, ec))
      if (std::regex_match(e.path().filename().string(), shard_re)) fs::remove(e.path(), ec);
  } else if (fs::exists(record_path)) {
    if (read_text(record_path) != record) {
      throw_error<UsageError>(
          "convert nuscenes: '{}' holds a conversion made with other options "
          "(its convert.json); pass the same options to resume it, or "
          "--overwrite to start again",
          o.out);
    }
  } else if (fs::exists(join_path(o.out, "dataset.json"))) {
    throw_error<UsageError>(
        "convert nuscenes: '{}' already holds a dataset; pass --overwrite to "
        "replace it",
        o.out);
  }
  for (const auto& e : fs::directory_iterator(o.out, ec)) {
    if (e.path().extension() == ".tmp") fs::remove(e.path(), ec);  // a killed run's partial shard
  }
  if (!fs::exists(record_path)) write_text_atomically(record_path, record);

  DatasetInfo info;
  info.dir = o.out;
  info.generator = fmt::format(
      "parallax convert nuscenes ({}; ego origin {} m ahead of the rear axle; source JPEGs {})",
      o.version, o.ego_x_offset, cv.passthrough ? "stored as they are" : "decoded and resized");
  info.cameras = static_cast<int64_t>(o.cameras.size());
  info.image_height = cv.height;
  info.image_width = cv.width;
  info.image_codec = o.image_codec;
  info.jpeg_quality = o.image_codec == "jpeg" ? (cv.passthrough ? 0 : o.quality) : 0;
  info.bev = o.bev;
  info.bev_classes = {"background"};
  if (cv.maps.empty()) {
    info.bev_source = "box footprints";
  } else {
    info.bev_source = "map expansion layers and box footprints";
    for (const char* c : {"drivable_area", "ped_crossing", "walkway", "divider"})
      info.bev_classes.push_back(c);
  }
  for (const auto& c : cv.classes) info.bev_classes.push_back(c);
  info.box_classes = cv.classes;
  for (const auto& [split, samples] : by_split) {
    SplitInfo si;
    si.scenes = static_cast<int64_t>(samples.size());
    for (int64_t s = 0; s * o.shard_scenes < si.scenes; ++s)
      si.shards.push_back(fmt::format("{}_{:05d}.h5", split, s));
    info.splits[split] = si;
  }

  // Shards already complete (a resumed conversion) are kept: their jobs are skipped.
  std::set<std::string> done;
  for (const auto& [split, si] : info.splits) {
    for (size_t s = 0; s < si.shards.size(); ++s) {
      const std::string path = join_path(o.out, si.shards[s]);
      if (!fs::exists(path)) continue;
      const int64_t first = static_cast<int64_t>(s) * o.shard_scenes;
      const int64_t count = std::min(o.shard_scenes, si.scenes - first);
      bool ok = false;
      try {
        ShardReader r(path);
        ok = static_cast<int64_t>(r.scene_indices().size()) == count &&
             r.scene_indices().front() == first;
      } catch (const DataError&) {
      }
      if (ok) {
        done.insert(si.shards[s]);
      } else {
        fs::remove(path, ec);
      }
    }
  }
  std::vector<Job> todo;
  for (const Job& j : jobs) {
    const std::string shard =
        info.splits.at(j.split).shards.at(static_cast<size_t>(j.index / o.shard_scenes));
    if (!done.count(shard)) todo.push_back(j);
  }
  NuScenesConvertSummary summary;
  summary.shards_kept = static_cast<int64_t>(done.size());
  if (!done.empty())
    core::log::info("convert nuscenes: resuming: {} complete shard(s) kept, {} of {} samples to go",
                    done.size(), todo.size(), jobs.size());

  const int workers = o.workers > 0
                          ? o.workers
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  core::log::info("convert nuscenes: {} samples, {} cameras of {} x {} ({}), {} workers -> {}",
                  jobs.size(), info.cameras, cv.height, cv.width,
                  cv.passthrough ? "source JPEG bytes" : o.image_codec, workers, o.out);
  core::Progress progress("convert sample", static_cast<int64_t>(todo.size()),
                          o.progress_interval_s);
  {
    OrderedPool<SceneRecord> pool(static_cast<int64_t>(todo.size()), workers, [&](int64_t j) {
      SceneRecord r = cv.make(todo[static_cast<size_t>(j)]);
      r.index = todo[static_cast<size_t>(j)].index;
      return r;
    });
    std::unique_ptr<ShardWriter> writer;
    std::string writer_shard;
    for (int64_t j = 0; j < static_cast<int64_t>(todo.size()); ++j) {
      const Job& job = todo[static_cast<size_t>(j)];
      SceneRecord rec = pool.take(j);
      const std::string shard =
          info.splits.at(job.split).shards.at(static_cast<size_t>(job.index / o.shard_scenes));
      if (!writer || writer_shard != shard) {
        if (writer) writer->close();
        writer = std::make_unique<ShardWriter>(join_path(o.out, shard), o.compression,
                                               o.image_codec == "jpeg" ? o.quality : 0);
        writer_shard = shard;
      }
      writer->write(rec);
      progress.update(j + 1, job.split);
    }
    if (writer) writer->close();
  }
  write_dataset_json(o.out, info);
  for (const auto& [split, si] : info.splits)
    for (const auto& s : si.shards)
      summary.bytes += static_cast<int64_t>(fs::file_size(fs::path(o.out) / s, ec));
  summary.seconds = progress.elapsed_s();
  progress.finish(fmt::format("{} on disk", core::human_bytes(static_cast<double>(summary.bytes))));
  summary.info = info;
  summary.samples = static_cast<int64_t>(jobs.size());
  summary.boxes = cv.boxes;
  summary.ignored_categories = cv.ignored;
  for (const auto& [name, count] : cv.ignored) summary.ignored_boxes += count;
  return summary;
}

// ---- The synthetic layout -----------------------------------------------------------------

namespace {

// The synthetic log's location: one of the four the devkit's map API accepts (its map file then
// holds the synthetic roads, not Boston's).
constexpr const char* kSyntheticLocation = "boston-seaport";

// A deterministic 32-hex-digit token.
std::string make_token(uint64_t seed, const std::string& kind, int64_t a, int64_t b = 0) {
  uint64_t h = 1469598103934665603ULL;
  for (char c : kind) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  const uint64_t x =
      core::derive_seed(seed, h, static_cast<uint64_t>(a) * 1000003ULL + static_cast<uint64_t>(b));
  const uint64_t y = core::derive_seed(x, 0x9e3779b97f4a7c15ULL, 7);
  return fmt::format("{:016x}{:016x}", x, y);
}

json quat_json(const geom::Mat3& r) {
  const auto q = geom::quaternion_wxyz(r);
  return json::array({q[0], q[1], q[2], q[3]});
}
json vec_json(const geom::Vec3& v) {
  return json::array({v.x, v.y, v.z});
}

void write_json_file(const std::string& path, const json& j) {
  write_text_atomically(path, j.dump() + "\n");
}

}  // namespace

void write_nuscenes_layout(const NuScenesLayoutOptions& lo) {
  const DatagenOptions& o = lo.datagen;
  if (o.out.empty()) throw UsageError("datagen: --out DIR is required");
  if (o.gen.cameras != 6)
    throw_error<UsageError>(
        "datagen --layout nuscenes: --cameras must be 6 (nuScenes' rig), got {}", o.gen.cameras);
  if (!jpeg_available())
    throw UsageError(
        "datagen --layout nuscenes: this build has no JPEG codec (install "
        "libturbojpeg0-dev and rebuild)");
  if (!std::regex_match(lo.version, std::regex("v1\\.0-[A-Za-z0-9_-]+")))
    throw_error<UsageError>("datagen: --version must look like v1.0-mini, got '{}'", lo.version);
  if (lo.samples_per_scene < 1)
    throw_error<UsageError>("datagen: --samples-per-scene must be >= 1, got {}",
                            lo.samples_per_scene);
  const std::string tables = join_path(o.out, lo.version);
  std::error_code ec;
  if (fs::exists(join_path(tables, "sample.json")) && !o.overwrite)
    throw_error<UsageError>(
        "datagen: '{}' already holds a nuScenes layout; pass --overwrite to replace it", o.out);
  fs::create_directories(tables, ec);
  if (ec) throw_error<IoError>("cannot create '{}': {}", tables, ec.message());
  const auto& cams = nuscenes_cameras();
  std::vector<std::string> dirs = cams;
  dirs.push_back("LIDAR_TOP");
  for (const auto& c : dirs) {
    fs::create_directories(fs::path(o.out) / "samples" / c, ec);
    if (ec) throw_error<IoError>("cannot create '{}/samples/{}': {}", o.out, c, ec.message());
  }
  const uint64_t seed = o.seed;
  const int threads = o.threads > 0
                          ? o.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  json sample = json::array(), sample_data = json::array(), ego_pose = json::array(),
       calibrated_sensor = json::array(), sensor = json::array(), annotation = json::array(),
       instance = json::array(), category = json::array(), scene = json::array(),
       log = json::array(), visibility = json::array(), attribute = json::array(),
       map = json::array();
  // The synthetic classes as nuScenes categories (a cyclist is a bicycle with a rider).
  const std::vector<std::pair<std::string, std::string> > cats = {
      {"vehicle.car", "Vehicle designed primarily for personal use."},
      {"human.pedestrian.adult", "Adult subcategory."},
      {"vehicle.bicycle", "Human or electric powered 2-wheeled vehicle."}};
  std::vector<std::string> cat_tokens;
  for (size_t i = 0; i < cats.size(); ++i) {
    cat_tokens.push_back(make_token(seed, "category", static_cast<int64_t>(i)));
    category.push_back(
        {{"token", cat_tokens.back()}, {"name", cats[i].first}, {"description", cats[i].second}});
  }
  const std::vector<std::string> vis_levels = {"v0-40", "v40-60", "v60-80", "v80-100"};
  for (size_t i = 0; i < vis_levels.size(); ++i) {
    visibility.push_back(
        {{"token", std::to_string(i + 1)},
         {"level", vis_levels[i]},
         {"description", "visibility of whole object is between " + vis_levels[i]}});
  }
  std::vector<std::string> sensor_tokens;
  for (size_t i = 0; i < cams.size(); ++i) {
    sensor_tokens.push_back(make_token(seed, "sensor", static_cast<int64_t>(i)));
    sensor.push_back(
        {{"token", sensor_tokens.back()}, {"channel", cams[i]}, {"modality", "camera"}});
  }
  // A LIDAR_TOP per sample (its keyframe's ego pose is the sample's reference, for the converter
  // and for the devkit's evaluation), without points: its files are empty.
  const std::string lidar_sensor = make_token(seed, "sensor", 100);
  sensor.push_back({{"token", lidar_sensor}, {"channel", "LIDAR_TOP"}, {"modality", "lidar"}});
  const std::string log_token = make_token(seed, "log", 0);
  log.push_back({{"token", log_token},
                 {"logfile", "parallax-synthetic"},
                 {"vehicle", "parallax"},
                 {"date_captured", "2026-11-29"},
                 {"location", kSyntheticLocation}});
  map.push_back({{"token", make_token(seed, "map", 0)},
                 {"log_tokens", json::array({log_token})},
                 {"category", "semantic_prior"},
                 {"filename", ""}});

  // The map expansion file of that location: each sample's roads (drivable_area), sidewalks
  // (walkway) and lane lines (lane_divider; the centre line road_divider), in the global frame.
  json m_node = json::array(), m_polygon = json::array(), m_line = json::array(),
       m_drivable = json::array(), m_walkway = json::array(), m_lane_div = json::array(),
       m_road_div = json::array();
  int64_t map_id = 0;
  auto map_node = [&](const geom::Pose& ego, double x, double y) {
    const geom::Vec3 g = ego.apply({x, y, 0});
    const std::string tok = make_token(seed, "map_node", map_id++);
    m_node.push_back({{"token", tok}, {"x", g.x}, {"y", g.y}});
    return tok;
  };
  auto map_polygon = [&](const geom::Pose& ego, const Road& road, double s0, double s1, double t0,
                         double t1) {
    json ext = json::array();
    for (const auto& [s, t] : {std::pair{s0, t0}, {s1, t0}, {s1, t1}, {s0, t1}}) {
      double x = 0, y = 0;
      road.point(s, t, x, y);
      ext.push_back(map_node(ego, x, y));
    }
    const std::string tok = make_token(seed, "map_polygon", map_id++);
    m_polygon.push_back({{"token", tok}, {"exterior_node_tokens", ext}, {"holes", json::array()}});
    return tok;
  };
  auto map_line = [&](const geom::Pose& ego, const Road& road, double s0, double s1, double t) {
    json nodes = json::array();
    for (double s : {s0, s1}) {
      double x = 0, y = 0;
      road.point(s, t, x, y);
      nodes.push_back(map_node(ego, x, y));
    }
    const std::string tok = make_token(seed, "map_line", map_id++);
    m_line.push_back({{"token", tok}, {"node_tokens", nodes}});
    return tok;
  };
  int64_t placed = 0;  // samples placed so far: sample n sits near x = 500 n m
  // One sensor reading of a keyframe sample: its ego pose and its sample_data record.
  auto add_sample_data = [&](const std::string& sd_token, const std::string& ep_token,
                             const std::string& cs_token, const std::string& sample_token,
                             int64_t ts, const geom::Pose& ego, const char* format, int64_t h,
                             int64_t w, const std::string& file) {
    ego_pose.push_back({{"token", ep_token},
                        {"timestamp", ts},
                        {"rotation", quat_json(ego.R)},
                        {"translation", vec_json(ego.t)}});
    sample_data.push_back({{"token", sd_token},
                           {"sample_token", sample_token},
                           {"ego_pose_token", ep_token},
                           {"calibrated_sensor_token", cs_token},
                           {"timestamp", ts},
                           {"fileformat", format},
                           {"is_key_frame", true},
                           {"height", h},
                           {"width", w},
                           {"filename", file},
                           {"prev", ""},
                           {"next", ""}});
  };

  json splits = json::object();
  int64_t scene_no = 0;
  const int64_t base_us = 1764374400000000;  // 2025-11-29 00:00 UTC
  for (const auto& [split, n] :
       {std::pair<std::string, int64_t>{"train", o.train_scenes}, {"val", o.val_scenes}}) {
    splits[split] = json::array();
    if (n == 0) continue;
    const uint64_t sseed = split_seed(seed, split);
    OrderedPool<GeneratedScene> pool(n, threads,
                                     [&](int64_t i) { return generate_scene(o.gen, sseed, i); });
    std::string scene_token, first_sample, prev_sample;
    int64_t in_scene = 0;
    json* scene_row = nullptr;
    for (int64_t i = 0; i < n; ++i) {
      GeneratedScene g = pool.take(i);
      if (in_scene == 0) {
        scene_token = make_token(seed, "scene", scene_no);
        const std::string name = fmt::format("scene-{:04d}", scene_no);
        scene.push_back({{"token", scene_token},
                         {"log_token", log_token},
                         {"nbr_samples", 0},
                         {"first_sample_token", ""},
                         {"last_sample_token", ""},
                         {"name", name},
                         {"description", fmt::format("parallax synthetic {} scene {}", split, i)}});
        scene_row = &scene.back();
        splits[split].push_back(name);
        prev_sample.clear();
      }
      const int64_t ts = base_us + scene_no * 100000000 + in_scene * 500000;
      const std::string stoken = make_token(seed, "sample", scene_no, in_scene);
      // A random global ego pose (yaw only, on the ground, as nuScenes' localisation gives).
      std::mt19937_64 rng(core::derive_seed(sseed, static_cast<uint64_t>(i), 977));
      // Samples 500 m apart in x (each one's map reaches ~120 m from it, so they never overlap).
      std::uniform_real_distribution<double> jitter(-100, 100), side(-1000, 1000),
          ang(-geom::kPi, geom::kPi);
      const double ex = 500.0 * static_cast<double>(placed++) + jitter(rng), ey = side(rng),
                   eyaw = ang(rng);
      const geom::Pose ego{geom::Mat3::rot_z(eyaw), {ex, ey, 0}};
      sample.push_back({{"token", stoken},
                        {"timestamp", ts},
                        {"prev", prev_sample},
                        {"next", ""},
                        {"scene_token", scene_token}});
      if (!prev_sample.empty()) {
        // The previous sample is the one before last in the list.
        sample[sample.size() - 2]["next"] = stoken;
      } else {
        (*scene_row)["first_sample_token"] = stoken;
      }
      (*scene_row)["last_sample_token"] = stoken;
      (*scene_row)["nbr_samples"] = in_scene + 1;
      const SceneRecord& r = g.record;
      {
        const int64_t id = scene_no * 1000 + in_scene;
        const std::string sd_token = make_token(seed, "sample_data", id, 100);
        const std::string ep_token = make_token(seed, "ego_pose", id, 100);
        const std::string cs_token = make_token(seed, "calibrated_sensor", id, 100);
        const std::string file =
            fmt::format("samples/LIDAR_TOP/parallax-synthetic__LIDAR_TOP__{}.pcd.bin", ts);
        std::ofstream(join_path(o.out, file), std::ios::binary | std::ios::trunc);
        calibrated_sensor.push_back({{"token", cs_token},
                                     {"sensor_token", lidar_sensor},
                                     {"translation", json::array({0.94, 0.0, 1.84})},
                                     {"rotation", json::array({1.0, 0.0, 0.0, 0.0})},
                                     {"camera_intrinsic", json::array()}});
        add_sample_data(sd_token, ep_token, cs_token, stoken, ts, ego, "pcd", 0, 0, file);
      }
      for (const Road& road : g.layout.roads) {
        const double s0 = std::max(road.s_min, -100.0), s1 = std::min(road.s_max, 100.0);
        const double hw = road.half_width();
        m_drivable.push_back(
            {{"token", make_token(seed, "drivable_area", map_id++)},
             {"polygon_tokens", json::array({map_polygon(ego, road, s0, s1, -hw, hw)})}});
        for (double sign : {1.0, -1.0}) {
          const double a = sign * hw, b = sign * (hw + road.sidewalk);
          m_walkway.push_back(
              {{"token", make_token(seed, "walkway", map_id++)},
               {"polygon_token", map_polygon(ego, road, s0, s1, std::min(a, b), std::max(a, b))}});
        }
        for (int k = 1; k < road.lanes; ++k) {
          const std::string line = map_line(ego, road, s0, s1, -hw + k * road.lane_width);
          (k == road.forward_lanes ? m_road_div : m_lane_div)
              .push_back({{"token", make_token(seed, "divider", map_id++)}, {"line_token", line}});
        }
      }
      for (size_t c = 0; c < cams.size(); ++c) {
        const int64_t cts = ts + static_cast<int64_t>(c) * 8000;  // cameras fire in turn
        const std::string sd_token =
            make_token(seed, "sample_data", scene_no * 1000 + in_scene, static_cast<int64_t>(c));
        const std::string ep_token =
            make_token(seed, "ego_pose", scene_no * 1000 + in_scene, static_cast<int64_t>(c));
        const std::string cs_token = make_token(
            seed, "calibrated_sensor", scene_no * 1000 + in_scene, static_cast<int64_t>(c));
        const std::string file =
            fmt::format("samples/{}/parallax-synthetic__{}__{}.jpg", cams[c], cams[c], cts);
        const auto bytes =
            encode_jpeg(r.images[static_cast<int64_t>(c)], o.jpeg_quality,
                        fmt::format("datagen: sample '{}' camera {}", stoken, cams[c]));
        {
          const std::string path = join_path(o.out, file);
          std::ofstream f(path, std::ios::binary | std::ios::trunc);
          f.write(reinterpret_cast<const char*>(bytes.data()),
                  static_cast<std::streamsize>(bytes.size()));
          f.flush();
          if (!f) throw_error<IoError>("cannot write '{}' (disk full?)", path);
        }
        // The stored float32 camera, as the native dataset holds it.
        const geom::Camera cam = geom::camera_from_tensors(r.intrinsics[static_cast<int64_t>(c)],
                                                           r.cam_to_ego[static_cast<int64_t>(c)],
                                                           o.gen.height, o.gen.width);
        calibrated_sensor.push_back(
            {{"token", cs_token},
             {"sensor_token", sensor_tokens[c]},
             {"translation", vec_json(cam.cam_to_ego.t)},
             {"rotation", quat_json(cam.cam_to_ego.R)},
             {"camera_intrinsic", json::array({json::array({cam.K.fx, 0.0, cam.K.cx}),
                                               json::array({0.0, cam.K.fy, cam.K.cy}),
                                               json::array({0.0, 0.0, 1.0})})}});
        add_sample_data(sd_token, ep_token, cs_token, stoken, cts, ego, "jpg", o.gen.height,
                        o.gen.width, file);
      }
      // Boxes: ego -> global. Each object is its own instance (the scenes are independent).
      const float* b = r.boxes.data_ptr<float>();
      for (int64_t k = 0; k < r.boxes.size(0); ++k) {
        const float* row = b + k * kBoxColumns;
        const std::string at = make_token(seed, "annotation", scene_no * 1000 + in_scene, k);
        const std::string it = make_token(seed, "instance", scene_no * 1000 + in_scene, k);
        const auto cls = static_cast<size_t>(row[kBoxClass]);
        const geom::Vec3 c = ego.apply({row[kBoxX], row[kBoxY], row[kBoxZ]});
        const geom::Mat3 rot = ego.R * geom::Mat3::rot_z(row[kBoxYaw]);
        const double vis = row[kBoxVisibility];
        const int level = vis < 0.4 ? 1 : vis < 0.6 ? 2 : vis < 0.8 ? 3 : 4;
        annotation.push_back(
            {{"token", at},
             {"sample_token", stoken},
             {"instance_token", it},
             {"visibility_token", std::to_string(level)},
             {"attribute_tokens", json::array()},
             {"translation", vec_json(c)},
             {"size", json::array({static_cast<double>(row[kBoxW]), static_cast<double>(row[kBoxL]),
                                   static_cast<double>(row[kBoxH])})},
             {"rotation", quat_json(rot)},
             {"prev", ""},
             {"next", ""},
             // visibility is the fraction of the box's 9 points seen: a count out of 9
             {"num_lidar_pts", static_cast<int64_t>(std::lround(vis * 9))},
             {"num_radar_pts", 0}});
        instance.push_back({{"token", it},
                            {"category_token", cat_tokens.at(cls)},
                            {"nbr_annotations", 1},
                            {"first_annotation_token", at},
                            {"last_annotation_token", at}});
      }
      prev_sample = stoken;
      if (++in_scene == lo.samples_per_scene) {
        in_scene = 0;
        ++scene_no;
      }
    }
    if (in_scene != 0) {
      in_scene = 0;
      ++scene_no;
    }
  }
  const std::vector<std::pair<std::string, const json*> > out = {
      {"sample", &sample},
      {"sample_data", &sample_data},
      {"ego_pose", &ego_pose},
      {"calibrated_sensor", &calibrated_sensor},
      {"sensor", &sensor},
      {"sample_annotation", &annotation},
      {"instance", &instance},
      {"category", &category},
      {"scene", &scene},
      {"log", &log},
      {"visibility", &visibility},
      {"attribute", &attribute},
      {"map", &map}};
  for (const auto& [name, j] : out) write_json_file(join_path(tables, name + ".json"), *j);
  write_json_file(join_path(o.out, "parallax_splits.json"), splits);
  {
    const std::string dir = join_path(join_path(o.out, "maps"), "expansion");
    fs::create_directories(dir, ec);
    if (ec) throw_error<IoError>("cannot create '{}': {}", dir, ec.message());
    json mj = {{"version", "1.3"},
               {"canvas_edge", json::array({10000.0, 10000.0})},
               {"node", m_node},
               {"polygon", m_polygon},
               {"line", m_line},
               {"drivable_area", m_drivable},
               {"road_segment", json::array()},
               {"road_block", json::array()},
               {"lane", json::array()},
               {"ped_crossing", json::array()},
               {"walkway", m_walkway},
               {"stop_line", json::array()},
               {"carpark_area", json::array()},
               {"road_divider", m_road_div},
               {"lane_divider", m_lane_div},
               {"traffic_light", json::array()},
               {"arcline_path_3", json::object()},
               {"connectivity", json::object()},
               {"lane_connector", json::array()}};
    write_json_file(join_path(dir, std::string(kSyntheticLocation) + ".json"), mj);
  }
  core::log::info("datagen: wrote a nuScenes {} layout to {}: {} scenes, {} samples, {} boxes",
                  lo.version, o.out, scene.size(), sample.size(), annotation.size());
}

#endif  // PARALLAX_WITH_NUSCENES

}  // namespace parallax::data
