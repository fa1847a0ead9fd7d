// The converter's inputs (data/nuscenes_impl.h): the nuScenes tables, the rules every value read
// from them passes, the --classes and --splits files, and the map expansion layers.
#if PARALLAX_WITH_NUSCENES

#include "data/nuscenes_impl.h"

#include "core/error.h"
#include "core/strings.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <set>
#include <sstream>

namespace fs = std::filesystem;

namespace parallax::data::nusc {

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

geom::Pose compose(const geom::Pose& a, const geom::Pose& b) {
  return {a.R * b.R, a.R * b.t + a.t};
}
geom::Pose inverse(const geom::Pose& p) {
  const geom::Mat3 rt = p.R.transpose();
  return {rt, rt * (p.t * -1.0)};
}

// ---- Tables ---------------------------------------------------------------------------------

const json& Table::at(const std::string& token, const std::string& referrer) const {
  const auto it = by_token.find(token);
  if (it == by_token.end()) {
    throw_error<DataError>("nuScenes: {} points to {} token '{}', which '{}' does not hold",
                           referrer, name, core::clip(token), file);
  }
  return *it->second;
}

std::string where(const Table& t, const json& row) {
  const auto it = row.find("token");
  return fmt::format("'{}' record '{}'", t.file,
                     it != row.end() && it->is_string() ? core::clip(it->get<std::string>()) : "?");
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

namespace {

bool finite_f32(double x) {
  return std::isfinite(x) && std::abs(x) <= static_cast<double>(std::numeric_limits<float>::max());
}

[[noreturn]] void not_f32(const Table& t, const json& row, const std::string& what, double x) {
  throw_error<DataError>(
      "nuScenes: {} field '{}' holds {}, which is not finite in float32 (|x| <= {:g}; the "
      "dataset stores float32)",
      where(t, row), what, x, static_cast<double>(std::numeric_limits<float>::max()));
}

}  // namespace

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
    if (!finite_f32(x)) not_f32(t, row, key, x);
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

std::array<double, 9> intrinsic_of(const Table& t, const json& row) {
  const json& kj = field(t, row, "camera_intrinsic");
  std::array<double, 9> k{};
  bool ok = kj.is_array() && kj.size() == 3;
  for (size_t i = 0; ok && i < 3; ++i) {
    ok = kj[i].is_array() && kj[i].size() == 3;
    for (size_t j = 0; ok && j < 3; ++j) {
      ok = kj[i][j].is_number();
      if (ok) k[i * 3 + j] = kj[i][j].get<double>();
    }
  }
  if (!ok) {
    throw_error<DataError>("nuScenes: {} field 'camera_intrinsic' is not a 3 x 3 camera matrix",
                           where(t, row));
  }
  for (double x : k) {
    if (!finite_f32(x)) not_f32(t, row, "camera_intrinsic", x);
  }
  if (!(k[0] > 0) || !(k[4] > 0)) {
    throw_error<DataError>(
        "nuScenes: {} field 'camera_intrinsic' is not a camera matrix (fx and fy must be > 0)",
        where(t, row));
  }
  return k;
}

float to_f32(double v, const Table& t, const json& row, const std::string& what) {
  if (!finite_f32(v)) not_f32(t, row, what, v);
  return static_cast<float>(v);
}

Table load_table(const std::string& dir, const std::string& name, bool required) {
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
    throw_error<DataError>("nuScenes: table '{}' is not valid JSON: {}", t.file,
                           core::clip(e.what(), 200));
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
                             core::clip(it->get<std::string>()));
  }
  return t;
}

std::string table_path_problem(const std::string& path) {
  if (path.empty()) return "is empty";
  for (const char c : path) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) return "contains a control character";
  }
  const fs::path p(path);
  if (p.is_absolute() || p.has_root_directory()) return "is an absolute path";
  for (const auto& part : p) {
    if (part == "..") return "has a '..' component";
  }
  return "";
}

std::string table_path(const Table& t, const json& row, const char* key) {
  const std::string p = str(t, row, key);
  const std::string problem = table_path_problem(p);
  if (!problem.empty()) {
    throw_error<DataError>(
        "nuScenes: {} field '{}' is '{}', which {}; paths in the tables must be relative to the "
        "dataroot and stay inside it",
        where(t, row), key, core::clip(p), problem);
  }
  return p;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// ---- The user's files: --classes, --splits -------------------------------------------------

namespace {

// {key: value} or {key: [values]} from a YAML or JSON file.
YAML::Node load_yaml_map(const std::string& path, const std::string& flag) {
  YAML::Node n;
  try {
    n = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    throw_error<UsageError>("convert: {} '{}' cannot be read", flag, core::clip(path, 200));
  } catch (const YAML::Exception& e) {
    throw_error<UsageError>("convert: {} '{}' is not valid YAML/JSON: {}", flag,
                            core::clip(path, 200), core::clip(e.what(), 200));
  }
  if (!n.IsMap())
    throw_error<UsageError>("convert: {} '{}' must hold a mapping", flag, core::clip(path, 200));
  return n;
}

}  // namespace

// The category -> class mapping (--classes, or the detection task's); returns the file's text
// for convert.json ("" for the default).
std::string read_classes(Converter& cv) {
  const NuScenesConvertOptions& o = cv.o;
  std::string text;
  if (o.classes_file.empty()) {
    cv.category_class = nuscenes_default_category_map();
    cv.classes = nuscenes_detection_classes();
  } else {
    const std::string file = core::clip(o.classes_file, 200);
    const YAML::Node n = load_yaml_map(o.classes_file, "--classes");
    text = nusc::read_text(o.classes_file);
    for (const auto& kv : n) {
      if (!kv.second.IsScalar())
        throw_error<UsageError>("convert: --classes '{}': '{}' must map to a class name", file,
                                core::clip(kv.first.as<std::string>()));
      const std::string cls = kv.second.as<std::string>();
      cv.category_class[kv.first.as<std::string>()] = cls;
      if (std::find(cv.classes.begin(), cv.classes.end(), cls) == cv.classes.end())
        cv.classes.push_back(cls);
    }
    if (cv.classes.empty())
      throw_error<UsageError>("convert: --classes '{}' maps no category", file);
  }
  if (cv.classes.size() > 250)
    throw_error<UsageError>("convert: {} classes; at most 250 (BEV labels are uint8)",
                            cv.classes.size());
  for (size_t i = 0; i < cv.classes.size(); ++i)
    cv.class_index[cv.classes[i]] = static_cast<int64_t>(i);
  return text;
}

// --splits: every scene it names must be in the scene table (a typo would drop a scene silently).
Splits read_splits(const Converter& cv) {
  Splits s;
  const NuScenesConvertOptions& o = cv.o;
  if (o.splits_file.empty()) return s;
  const std::string file = core::clip(o.splits_file, 200);
  const YAML::Node n = load_yaml_map(o.splits_file, "--splits");
  s.text = nusc::read_text(o.splits_file);
  for (const auto& kv : n) {
    const std::string split = kv.first.as<std::string>();
    if (!std::regex_match(split, std::regex("[A-Za-z0-9_-]{1,32}")))
      throw_error<UsageError>("convert: --splits '{}': split name '{}' (letters, digits, _ and -)",
                              file, core::clip(split));
    if (!kv.second.IsSequence())
      throw_error<UsageError>("convert: --splits '{}': '{}' must list scene names", file, split);
    for (const auto& e : kv.second) {
      if (!e.IsScalar())
        throw_error<UsageError>("convert: --splits '{}': '{}' must list scene names", file, split);
      const std::string name = e.as<std::string>();
      if (!s.split_of.emplace(name, split).second)
        throw_error<UsageError>("convert: --splits '{}': scene '{}' is in two splits", file,
                                core::clip(name));
    }
  }
  std::set<std::string> names;
  for (const auto& sc : cv.scene.rows) names.insert(str(cv.scene, sc, "name"));
  std::vector<std::string> unknown;
  for (const auto& [name, split] : s.split_of) {
    if (!names.count(name)) unknown.push_back(name);
  }
  if (!unknown.empty()) {
    const std::string& name = unknown.front();
    const std::string hint =
        name.size() > 64
            ? ""
            : core::did_you_mean(name, std::vector<std::string>(names.begin(), names.end()));
    throw_error<UsageError>(
        "convert: --splits '{}': scene '{}' (split '{}'){} is not in '{}'{}", file,
        core::clip(name), s.split_of.at(name),
        unknown.size() > 1 ? fmt::format(" and {} more", unknown.size() - 1) : std::string(),
        cv.scene.file, hint);
  }
  return s;
}

// ---- Map expansion layers -------------------------------------------------------------------

namespace {

// Class index (in bev_classes) of each layer: background 0, then drivable_area, ped_crossing,
// walkway, divider.
const uint8_t kMapClass[kMapLayers] = {3, 1, 2, 4};

// The file's node table and its polygons and lines by token, each with its bounding box.
struct MapGeometry {
  std::string file;
  std::unordered_map<std::string, Pt> nodes;
  std::unordered_map<std::string, MapShape> polygons, lines;
};

const json& map_list(const json& j, const std::string& file, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_array())
    throw_error<DataError>("nuScenes: map expansion file '{}' has no list '{}'", file, key);
  return *it;
}

std::string map_text(const json& r, const std::string& file, const char* key, const char* layer) {
  const auto it = r.find(key);
  if (it == r.end() || !it->is_string())
    throw_error<DataError>("nuScenes: map '{}' layer '{}': a record without a string '{}'", file,
                           layer, key);
  return it->get<std::string>();
}

std::vector<Pt> map_ring(const MapGeometry& g, const json& tokens, const std::string& what) {
  std::vector<Pt> out;
  if (!tokens.is_array())
    throw_error<DataError>("nuScenes: map '{}': {} has no node list", g.file, what);
  for (const auto& t : tokens) {
    const auto it = t.is_string() ? g.nodes.find(t.get<std::string>()) : g.nodes.end();
    if (it == g.nodes.end())
      throw_error<DataError>("nuScenes: map '{}': {} points to a node that is not there", g.file,
                             what);
    out.push_back(it->second);
  }
  return out;
}

void bound(MapShape& s) {
  for (const auto& r : s.rings) {
    for (const Pt& p : r) {
      s.x0 = std::min(s.x0, p[0]), s.y0 = std::min(s.y0, p[1]);
      s.x1 = std::max(s.x1, p[0]), s.y1 = std::max(s.y1, p[1]);
    }
  }
}

MapGeometry map_geometry(const json& j, const std::string& file) {
  MapGeometry g;
  g.file = file;
  for (const auto& n : map_list(j, file, "node")) {
    const auto x = n.find("x"), y = n.find("y");
    if (x == n.end() || y == n.end() || !x->is_number() || !y->is_number())
      throw_error<DataError>("nuScenes: map '{}': node '{}' has no numeric x and y", file,
                             core::clip(map_text(n, file, "token", "node")));
    g.nodes[map_text(n, file, "token", "node")] = {x->get<double>(), y->get<double>()};
  }
  for (const auto& p : map_list(j, file, "polygon")) {
    const std::string tok = map_text(p, file, "token", "polygon");
    const std::string shown = "polygon '" + core::clip(tok) + "'";
    MapShape s;
    s.rings.push_back(map_ring(g, p.value("exterior_node_tokens", json()), shown));
    for (const auto& h : p.value("holes", json::array()))
      s.rings.push_back(map_ring(g, h.value("node_tokens", json()), "a hole of " + shown));
    bound(s);
    g.polygons[tok] = std::move(s);
  }
  for (const auto& l : map_list(j, file, "line")) {
    const std::string tok = map_text(l, file, "token", "line");
    MapShape s;
    s.rings.push_back(
        map_ring(g, l.value("node_tokens", json()), "line '" + core::clip(tok) + "'"));
    bound(s);
    g.lines[tok] = std::move(s);
  }
  return g;
}

}  // namespace

NuMap load_map(const std::string& file_in, const std::string& what) {
  const std::string file = core::clip(file_in, 300);
  std::ifstream f(file_in, std::ios::binary);
  if (!f) throw_error<DataError>("nuScenes: {}: map expansion file '{}' is missing", what, file);
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    throw_error<DataError>("nuScenes: map expansion file '{}' is not valid JSON: {}", file,
                           core::clip(e.what(), 200));
  }
  const MapGeometry g = map_geometry(j, file);
  auto polygon = [&](const std::string& tok, const char* layer) -> const MapShape& {
    const auto it = g.polygons.find(tok);
    if (it == g.polygons.end())
      throw_error<DataError>(
          "nuScenes: map '{}' layer '{}' points to polygon '{}', which is not "
          "there",
          file, layer, core::clip(tok));
    return it->second;
  };
  NuMap m;
  for (const auto& r : map_list(j, file, "drivable_area")) {
    for (const auto& t : r.value("polygon_tokens", json::array())) {
      if (!t.is_string())
        throw_error<DataError>(
            "nuScenes: map '{}' layer 'drivable_area': a polygon token that is "
            "not a string",
            file);
      m.layers[kDrivable].push_back(polygon(t.get<std::string>(), "drivable_area"));
    }
  }
  for (const auto& r : map_list(j, file, "ped_crossing"))
    m.layers[kCrossing].push_back(
        polygon(map_text(r, file, "polygon_token", "ped_crossing"), "ped_crossing"));
  for (const auto& r : map_list(j, file, "walkway"))
    m.layers[kWalkway].push_back(polygon(map_text(r, file, "polygon_token", "walkway"), "walkway"));
  for (const char* layer : {"lane_divider", "road_divider"}) {
    for (const auto& r : map_list(j, file, layer)) {
      const auto it = g.lines.find(map_text(r, file, "line_token", layer));
      if (it == g.lines.end())
        throw_error<DataError>("nuScenes: map '{}' layer '{}' points to a line that is not there",
                               file, layer);
      m.layers[kDivider].push_back(it->second);
    }
  }
  return m;
}

namespace {

// Even-odd rule over all rings (exterior and holes).
bool inside(const std::vector<std::vector<Pt>>& rings, double x, double y) {
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

// One shape (already in the ego frame) into the grid: a polygon's cells by their centres, a
// divider's cells whose centre lies within half a cell of it.
void paint_shape(const std::vector<std::vector<Pt>>& rings, bool line, uint8_t cls,
                 const BevGrid& g, uint8_t* p) {
  const int64_t X = g.x_cells(), Y = g.y_cells();
  double ex0 = 1e300, ey0 = 1e300, ex1 = -1e300, ey1 = -1e300;
  for (const auto& r : rings) {
    for (const Pt& e : r) {
      ex0 = std::min(ex0, e[0]), ey0 = std::min(ey0, e[1]);
      ex1 = std::max(ex1, e[0]), ey1 = std::max(ey1, e[1]);
    }
  }
  const double half = 0.5 * g.resolution;
  const double m = line ? half : 0.0;
  const auto ix0 =
      std::max<int64_t>(0, static_cast<int64_t>(std::floor((ex0 - m - g.x_min) / g.resolution)));
  const auto ix1 = std::min<int64_t>(
      X - 1, static_cast<int64_t>(std::floor((ex1 + m - g.x_min) / g.resolution)));
  const auto iy0 =
      std::max<int64_t>(0, static_cast<int64_t>(std::floor((ey0 - m - g.y_min) / g.resolution)));
  const auto iy1 = std::min<int64_t>(
      Y - 1, static_cast<int64_t>(std::floor((ey1 + m - g.y_min) / g.resolution)));
  for (int64_t ix = ix0; ix <= ix1; ++ix) {
    const double x = g.x_min + (static_cast<double>(ix) + 0.5) * g.resolution;
    for (int64_t iy = iy0; iy <= iy1; ++iy) {
      const double y = g.y_min + (static_cast<double>(iy) + 0.5) * g.resolution;
      bool hit = false;
      if (line) {
        const auto& r = rings.front();
        for (size_t i = 0; !hit && i + 1 < r.size(); ++i)
          hit = segment_distance(r[i], r[i + 1], x, y) <= half;
      } else {
        hit = inside(rings, x, y);
      }
      if (hit) p[ix * Y + iy] = cls;
    }
  }
}

}  // namespace

void paint_map(const NuMap& map, const geom::Pose& ref, const BevGrid& g, double ego_x_offset,
               at::Tensor& bev) {
  uint8_t* p = bev.data_ptr<uint8_t>();
  const double yaw = std::atan2(ref.R.m[1][0], ref.R.m[0][0]);
  const double c = std::cos(yaw), s = std::sin(yaw);
  auto to_global = [&](double x, double y) -> Pt {
    x += ego_x_offset;
    return {c * x - s * y + ref.t.x, s * x + c * y + ref.t.y};
  };
  auto to_ego = [&](const Pt& q) -> Pt {
    const double dx = q[0] - ref.t.x, dy = q[1] - ref.t.y;
    return {c * dx + s * dy - ego_x_offset, -s * dx + c * dy};
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
      std::vector<std::vector<Pt>> rings;
      for (const auto& r : sh.rings) {
        rings.emplace_back();
        for (const Pt& q : r) rings.back().push_back(to_ego(q));
      }
      paint_shape(rings, layer == kDivider, kMapClass[layer], g, p);
    }
  }
}

}  // namespace parallax::data::nusc

#endif  // PARALLAX_WITH_NUSCENES
