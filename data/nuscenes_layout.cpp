// `parallax datagen --layout nuscenes`: datagen's synthetic scenes written in the nuScenes layout
// (data/nuscenes.h, `write_nuscenes_layout`).
#if PARALLAX_WITH_NUSCENES

#include "data/nuscenes_impl.h"

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/rng.h"
#include "data/jpeg.h"
#include "data/ordered_pool.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>
#include <thread>

namespace fs = std::filesystem;

namespace parallax::data {
namespace {

using nusc::json;

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
  core::write_file_atomic(path, j.dump() + "\n");
}

void check_layout_options(const NuScenesLayoutOptions& lo) {
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
  if (o.gen.sequence_length < 1 || o.gen.frame_interval_us < 1) {
    throw_error<UsageError>(
        "datagen: --sequence-length must be >= 1 and --frame-interval at least 1 us, got {} and "
        "{} us",
        o.gen.sequence_length, o.gen.frame_interval_us);
  }
  if (lo.samples_per_scene < 1)
    throw_error<UsageError>("datagen: --samples-per-scene must be >= 1, got {}",
                            lo.samples_per_scene);
}

// The tables of the layout as they are built, and the map expansion file's layers.
struct Layout {
  const DatagenOptions& o;
  uint64_t seed;
  json sample = json::array(), sample_data = json::array(), ego_pose = json::array(),
       calibrated_sensor = json::array(), sensor = json::array(), annotation = json::array(),
       instance = json::array(), category = json::array(), scene = json::array(),
       log = json::array(), visibility = json::array(), attribute = json::array(),
       map = json::array();
  json m_node = json::array(), m_polygon = json::array(), m_line = json::array(),
       m_drivable = json::array(), m_walkway = json::array(), m_lane_div = json::array(),
       m_road_div = json::array();
  int64_t map_id = 0;
  std::vector<std::string> cat_tokens, sensor_tokens;
  std::string lidar_sensor, log_token;

  explicit Layout(const DatagenOptions& opts) : o(opts), seed(opts.seed) {}

  // The tables that do not depend on the scenes: categories, visibility, sensors, log, map.
  void add_fixed_tables() {
    // The synthetic classes as nuScenes categories (a cyclist is a bicycle with a rider).
    const std::vector<std::pair<std::string, std::string>> cats = {
        {"vehicle.car", "Vehicle designed primarily for personal use."},
        {"human.pedestrian.adult", "Adult subcategory."},
        {"vehicle.bicycle", "Human or electric powered 2-wheeled vehicle."}};
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
    const auto& cams = nuscenes_cameras();
    for (size_t i = 0; i < cams.size(); ++i) {
      sensor_tokens.push_back(make_token(seed, "sensor", static_cast<int64_t>(i)));
      sensor.push_back(
          {{"token", sensor_tokens.back()}, {"channel", cams[i]}, {"modality", "camera"}});
    }
    // A LIDAR_TOP per sample (its keyframe's ego pose is the sample's reference, for the
    // converter and for the devkit's evaluation), without points: its files are empty.
    lidar_sensor = make_token(seed, "sensor", 100);
    sensor.push_back({{"token", lidar_sensor}, {"channel", "LIDAR_TOP"}, {"modality", "lidar"}});
    log_token = make_token(seed, "log", 0);
    log.push_back({{"token", log_token},
                   {"logfile", "parallax-synthetic"},
                   {"vehicle", "parallax"},
                   {"date_captured", "2026-11-29"},
                   {"location", kSyntheticLocation}});
    map.push_back({{"token", make_token(seed, "map", 0)},
                   {"log_tokens", json::array({log_token})},
                   {"category", "semantic_prior"},
                   {"filename", ""}});
  }

  // ---- The map expansion file: each sample's roads (drivable_area), sidewalks (walkway) and
  // lane lines (lane_divider; the centre line road_divider), in the global frame.
  std::string map_node(const geom::Pose& ego, double x, double y) {
    const geom::Vec3 g = ego.apply({x, y, 0});
    const std::string tok = make_token(seed, "map_node", map_id++);
    m_node.push_back({{"token", tok}, {"x", g.x}, {"y", g.y}});
    return tok;
  }
  std::string map_polygon(const geom::Pose& ego, const Road& road, double s0, double s1, double t0,
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
  }
  std::string map_line(const geom::Pose& ego, const Road& road, double s0, double s1, double t) {
    json nodes = json::array();
    for (double s : {s0, s1}) {
      double x = 0, y = 0;
      road.point(s, t, x, y);
      nodes.push_back(map_node(ego, x, y));
    }
    const std::string tok = make_token(seed, "map_line", map_id++);
    m_line.push_back({{"token", tok}, {"node_tokens", nodes}});
    return tok;
  }
  void add_roads(const geom::Pose& ego, const SceneLayout& layout) {
    for (const Road& road : layout.roads) {
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
  }

  // One sensor reading of a keyframe sample: its ego pose and its sample_data record.
  void add_sample_data(const std::string& sd_token, const std::string& ep_token,
                       const std::string& cs_token, const std::string& sample_token, int64_t ts,
                       const geom::Pose& ego, const char* format, int64_t h, int64_t w,
                       const std::string& file) {
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
  }

  // Sample `id` (scene_no * 1000 + index in the scene)'s LIDAR_TOP: an empty file.
  void add_lidar(int64_t id, const std::string& stoken, int64_t ts, const geom::Pose& ego) {
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

  // Sample `id`'s cameras: the JPEG files, their calibrations and sample_data.
  void add_cameras(int64_t id, const std::string& stoken, int64_t ts, const geom::Pose& ego,
                   const SceneRecord& r) {
    const auto& cams = nuscenes_cameras();
    for (size_t c = 0; c < cams.size(); ++c) {
      const int64_t cts = ts + static_cast<int64_t>(c) * 8000;  // cameras fire in turn
      const auto ci = static_cast<int64_t>(c);
      const std::string sd_token = make_token(seed, "sample_data", id, ci);
      const std::string ep_token = make_token(seed, "ego_pose", id, ci);
      const std::string cs_token = make_token(seed, "calibrated_sensor", id, ci);
      const std::string file =
          fmt::format("samples/{}/parallax-synthetic__{}__{}.jpg", cams[c], cams[c], cts);
      const auto bytes =
          encode_jpeg(r.images[ci], o.jpeg_quality,
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
      const geom::Camera cam =
          geom::camera_from_tensors(r.intrinsics[ci], r.cam_to_ego[ci], o.gen.height, o.gen.width);
      calibrated_sensor.push_back(
          {{"token", cs_token},
           {"sensor_token", sensor_tokens[c]},
           {"translation", vec_json(cam.cam_to_ego.t)},
           {"rotation", quat_json(cam.cam_to_ego.R)},
           {"camera_intrinsic",
            json::array({json::array({cam.K.fx, 0.0, cam.K.cx}),
                         json::array({0.0, cam.K.fy, cam.K.cy}), json::array({0.0, 0.0, 1.0})})}});
      add_sample_data(sd_token, ep_token, cs_token, stoken, cts, ego, "jpg", o.gen.height,
                      o.gen.width, file);
    }
  }

  // Sample `id`'s boxes: ego -> global. Independent scenes: each object is its own instance. A
  // sequence's frames (`tracks` given): one instance per instance id of the sequence (nuScenes
  // scene `scene_no`), its annotations linked prev/next in frame order, as the devkit's velocity
  // needs; `tracks` maps an instance id to the rows of its last annotation and of its instance.
  void add_boxes(int64_t id, int64_t scene_no, const std::string& stoken, const geom::Pose& ego,
                 const SceneRecord& r, std::map<int64_t, std::pair<size_t, size_t>>* tracks) {
    const float* b = r.boxes.data_ptr<float>();
    for (int64_t k = 0; k < r.boxes.size(0); ++k) {
      const float* row = b + k * kBoxColumns;
      const std::string at = make_token(seed, "annotation", id, k);
      const int64_t iid = tracks ? r.instance_ids.data_ptr<int64_t>()[k] : 0;
      const std::string it = tracks ? make_token(seed, "sequence_instance", scene_no, iid)
                                    : make_token(seed, "instance", id, k);
      const auto track =
          tracks ? tracks->find(iid) : std::map<int64_t, std::pair<size_t, size_t>>::iterator();
      const bool seen = tracks && track != tracks->end();
      std::string prev;
      if (seen) {
        json& last = annotation[track->second.first];
        last["next"] = at;
        prev = last["token"].get<std::string>();
        json& inst = instance[track->second.second];
        inst["nbr_annotations"] = inst["nbr_annotations"].get<int64_t>() + 1;
        inst["last_annotation_token"] = at;
      }
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
           {"prev", prev},
           {"next", ""},
           // visibility is the fraction of the box's 9 points seen: a count out of 9
           {"num_lidar_pts", static_cast<int64_t>(std::lround(vis * 9))},
           {"num_radar_pts", 0}});
      if (seen) {
        track->second.first = annotation.size() - 1;
        continue;
      }
      instance.push_back({{"token", it},
                          {"category_token", cat_tokens.at(cls)},
                          {"nbr_annotations", 1},
                          {"first_annotation_token", at},
                          {"last_annotation_token", at}});
      if (tracks) (*tracks)[iid] = {annotation.size() - 1, instance.size() - 1};
    }
  }

  void write_tables(const std::string& tables) const {
    const std::vector<std::pair<std::string, const json*>> out = {
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
  }

  void write_map() const {
    const std::string dir = join_path(join_path(o.out, "maps"), "expansion");
    std::error_code ec;
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
};

// Where the splits' scenes stand while they are written: scene k's samples in order.
struct SceneCursor {
  int64_t scene_no = 0, in_scene = 0;
  int64_t placed = 0;  // samples placed so far: sample n sits near x = 500 n m
  std::string scene_token, prev_sample;
  size_t scene_row = 0;  // the scene's index in Layout::scene
  // A sequence (one nuScenes scene): its world's global pose, drawn at its first frame, and its
  // instances' last annotations (Layout::add_boxes).
  geom::Pose world;
  std::map<int64_t, std::pair<size_t, size_t>> tracks;
};

// Sample `i` of `split` (generated scene `g`): a new scene record when one starts, the sample, its
// map shapes, lidar, cameras and boxes.
void add_sample(Layout& L, SceneCursor& cur, const std::string& split, uint64_t sseed, int64_t i,
                const GeneratedScene& g, json& split_names) {
  const uint64_t seed = L.seed;
  if (cur.in_scene == 0) {
    cur.scene_token = make_token(seed, "scene", cur.scene_no);
    const std::string name = fmt::format("scene-{:04d}", cur.scene_no);
    L.scene.push_back({{"token", cur.scene_token},
                       {"log_token", L.log_token},
                       {"nbr_samples", 0},
                       {"first_sample_token", ""},
                       {"last_sample_token", ""},
                       {"name", name},
                       {"description", fmt::format("parallax synthetic {} scene {}", split, i)}});
    cur.scene_row = L.scene.size() - 1;
    split_names.push_back(name);
    cur.prev_sample.clear();
  }
  // A frame of a sequence: its sample time is the frame's, its ego pose the frame's pose in the
  // sequence's world carried to the world's global pose.
  const bool sequence = g.record.sequence >= 0;
  const int64_t base_us = 1764374400000000;  // 2025-11-29 00:00 UTC
  const int64_t ts = base_us + cur.scene_no * 100000000 +
                     (sequence ? g.record.timestamp_us : cur.in_scene * 500000);
  const std::string stoken = make_token(seed, "sample", cur.scene_no, cur.in_scene);
  if (!sequence || cur.in_scene == 0) {
    // A random global ego pose (yaw only, on the ground, as nuScenes' localisation gives).
    std::mt19937_64 rng(core::derive_seed(sseed, static_cast<uint64_t>(i), 977));
    // Samples (sequences) 500 m apart in x (each one's map reaches ~120 m from it, so they never
    // overlap), plus a sequence's longest drive (12 m/s over its frames).
    std::uniform_real_distribution<double> jitter(-100, 100), side(-1000, 1000),
        ang(-geom::kPi, geom::kPi);
    const double ex = 500.0 * static_cast<double>(cur.placed) + jitter(rng), ey = side(rng),
                 eyaw = ang(rng);
    const double drive_m =
        sequence
            ? 12e-6 * static_cast<double>((L.o.gen.sequence_length - 1) * L.o.gen.frame_interval_us)
            : 0.0;
    cur.placed += 1 + static_cast<int64_t>(drive_m / 500.0);
    cur.world = {geom::Mat3::rot_z(eyaw), {ex, ey, 0}};
    cur.tracks.clear();
  }
  geom::Pose ego = cur.world;
  if (sequence) {
    const double* T = g.record.ego_to_global.data_ptr<double>();
    geom::Pose frame;
    for (int r = 0; r < 3; ++r) {
      for (int c = 0; c < 3; ++c) frame.R.m[r][c] = T[r * 4 + c];
    }
    frame.t = {T[3], T[7], T[11]};
    ego = nusc::compose(cur.world, frame);
  }
  L.sample.push_back({{"token", stoken},
                      {"timestamp", ts},
                      {"prev", cur.prev_sample},
                      {"next", ""},
                      {"scene_token", cur.scene_token}});
  json& scene_row = L.scene[cur.scene_row];
  if (!cur.prev_sample.empty()) {
    // The previous sample is the one before last in the list.
    L.sample[L.sample.size() - 2]["next"] = stoken;
  } else {
    scene_row["first_sample_token"] = stoken;
  }
  scene_row["last_sample_token"] = stoken;
  scene_row["nbr_samples"] = cur.in_scene + 1;
  const int64_t id = cur.scene_no * 1000 + cur.in_scene;
  L.add_lidar(id, stoken, ts, ego);
  if (!sequence || cur.in_scene == 0) L.add_roads(ego, g.layout);  // one map per world
  L.add_cameras(id, stoken, ts, ego, g.record);
  L.add_boxes(id, cur.scene_no, stoken, ego, g.record, sequence ? &cur.tracks : nullptr);
  cur.prev_sample = stoken;
}

}  // namespace

void write_nuscenes_layout(const NuScenesLayoutOptions& lo) {
  check_layout_options(lo);
  const DatagenOptions& o = lo.datagen;
  const std::string tables = join_path(o.out, lo.version);
  std::error_code ec;
  if (fs::exists(join_path(tables, "sample.json")) && !o.overwrite)
    throw_error<UsageError>(
        "datagen: '{}' already holds a nuScenes layout; pass --overwrite to replace it", o.out);
  fs::create_directories(tables, ec);
  if (ec) throw_error<IoError>("cannot create '{}': {}", tables, ec.message());
  std::vector<std::string> dirs = nuscenes_cameras();
  dirs.push_back("LIDAR_TOP");
  for (const auto& c : dirs) {
    fs::create_directories(fs::path(o.out) / "samples" / c, ec);
    if (ec) throw_error<IoError>("cannot create '{}/samples/{}': {}", o.out, c, ec.message());
  }
  const int threads = o.threads > 0
                          ? o.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  Layout L(o);
  L.add_fixed_tables();
  json splits = json::object();
  SceneCursor cur;
  for (const auto& [split, n] :
       {std::pair<std::string, int64_t>{"train", o.train_scenes}, {"val", o.val_scenes}}) {
    splits[split] = json::array();
    if (n == 0) continue;
    const uint64_t sseed = split_seed(o.seed, split);
    OrderedPool<GeneratedScene> pool(n, threads,
                                     [&](int64_t i) { return generate_scene(o.gen, sseed, i); });
    cur.in_scene = 0;
    for (int64_t i = 0; i < n; ++i) {
      add_sample(L, cur, split, sseed, i, pool.take(i), splits[split]);
      // Sequences: one nuScenes scene per sequence.
      const int64_t per_scene =
          o.gen.sequence_length > 1 ? o.gen.sequence_length : lo.samples_per_scene;
      if (++cur.in_scene == per_scene) {
        cur.in_scene = 0;
        ++cur.scene_no;
      }
    }
    if (cur.in_scene != 0) {
      cur.in_scene = 0;
      ++cur.scene_no;
    }
  }
  L.write_tables(tables);
  write_json_file(join_path(o.out, "parallax_splits.json"), splits);
  L.write_map();
  core::log::info("datagen: wrote a nuScenes {} layout to {}: {} scenes, {} samples, {} boxes",
                  lo.version, o.out, L.scene.size(), L.sample.size(), L.annotation.size());
}

}  // namespace parallax::data

#endif  // PARALLAX_WITH_NUSCENES
