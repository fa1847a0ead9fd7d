// `parallax convert nuscenes` (data/nuscenes.h): the options, reading the tables and maps (with
// progress), the jobs, the output folder and its resume (kept shards verified), and the shards.
// One sample into one scene is nuscenes_sample.cpp; the tables' rules, --classes, --splits and
// the map layers nuscenes_tables.cpp; the synthetic layout nuscenes_layout.cpp.
#include "data/nuscenes.h"

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/strings.h"
#include "data/jpeg.h"
#include "data/nuscenes_impl.h"
#include "data/ordered_pool.h"
#include "data/shard.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <regex>
#include <set>
#include <thread>

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

using nusc::Converter;
using nusc::Job;
using nusc::json;
using nusc::Splits;
using nusc::str;
using nusc::Table;
using nusc::where;

void check_convert_options(const NuScenesConvertOptions& o) {
  auto bad = [](const std::string& what) { throw UsageError("convert nuscenes: " + what); };
  if (o.dataroot.empty()) bad("--dataroot DIR is required");
  if (o.out.empty()) bad("--out DIR is required");
  if (o.image_codec != "jpeg" && o.image_codec != "raw")
    bad(fmt::format("--image-codec must be jpeg or raw, got '{}'", core::clip(o.image_codec)));
  if (o.quality < 1 || o.quality > 100)
    bad(fmt::format("--quality must be in 1..100, got {}", o.quality));
  if (o.height < 0 || o.width < 0 || (o.height == 0) != (o.width == 0))
    bad("--image-size needs a height and a width >= 8 (or neither)");
  if (o.height > kNuScenesMaxImageSide || o.width > kNuScenesMaxImageSide)
    bad(fmt::format("--image-size {} {} is out of range: the height and the width must be in 8..{}",
                    o.height, o.width, kNuScenesMaxImageSide));
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
  const std::set<std::string> unique(o.cameras.begin(), o.cameras.end());
  if (unique.size() != o.cameras.size()) bad("--cameras lists a camera twice");
}

void check_version_folder(const NuScenesConvertOptions& o, const std::string& dir) {
  const std::string root = core::clip(o.dataroot, 200);
  if (!fs::is_directory(o.dataroot))
    throw_error<DataError>("nuScenes: --dataroot '{}' is not a folder", root);
  if (fs::is_directory(dir)) return;
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(o.dataroot, ec)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("v1.0-", 0) == 0) found.push_back(core::clip(n, 40));
  }
  std::sort(found.begin(), found.end());
  throw_error<DataError>("nuScenes: '{}' has no version folder '{}'{}", root, core::clip(o.version),
                         found.empty() ? std::string(" (and no v1.0-* folder at all)")
                                       : fmt::format("; it holds {}", core::join(found, ", ")));
}

// Long work reported in KiB of files read (the tables of v1.0-trainval are ~2 GiB of JSON; a
// table is one step, so the ETA follows the bytes, not the count of tables).
int64_t kib(int64_t bytes) {
  return (bytes + 1023) / 1024;
}
// KiB read for Progress::update: the total only after the last file (Progress always prints the
// total, so it comes once, at the end).
int64_t kib_read(int64_t done, int64_t total, bool last) {
  return last ? kib(total) : std::max<int64_t>(0, std::min(done / 1024, kib(total) - 1));
}
int64_t size_of_file(const std::string& path) {
  std::error_code ec;
  const auto n = fs::file_size(path, ec);
  return ec ? 0 : static_cast<int64_t>(n);
}

void read_tables(Converter& cv) {
  const std::vector<std::pair<Table*, const char*> > tables = {
      {&cv.sample, "sample"},     {&cv.sample_data, "sample_data"},
      {&cv.ego_pose, "ego_pose"}, {&cv.calibrated_sensor, "calibrated_sensor"},
      {&cv.sensor, "sensor"},     {&cv.annotation, "sample_annotation"},
      {&cv.instance, "instance"}, {&cv.category, "category"},
      {&cv.scene, "scene"},       {&cv.log, "log"}};
  int64_t total = 0, done = 0;
  for (const auto& [t, name] : tables)
    total += size_of_file(join_path(cv.dir, std::string(name) + ".json"));
  core::Progress progress("convert tables (KiB)", kib(total), cv.o.progress_interval_s);
  progress.update(0, "reading " + cv.o.version);
  for (size_t i = 0; i < tables.size(); ++i) {
    Table& t = *tables[i].first;
    t = nusc::load_table(cv.dir, tables[i].second);
    done += size_of_file(t.file);
    progress.update(kib_read(done, total, i + 1 == tables.size()),
                    tables[i].second + std::string(".json"));
  }
  cv.index();
}

// Map expansion layers, when `<dataroot>/maps/expansion` is there: one file per log location,
// each location checked as a path inside the dataroot (nusc::table_path).
void read_maps(Converter& cv) {
  const std::string expansion = join_path(join_path(cv.o.dataroot, "maps"), "expansion");
  if (!fs::is_directory(expansion)) {
    core::log::info("convert nuscenes: no '{}': BEV labels from the boxes' footprints alone",
                    core::clip(expansion, 200));
    return;
  }
  std::map<std::string, std::pair<std::string, const json*> > files;  // location -> file, log
  int64_t total = 0, done = 0;
  for (const auto& lg : cv.log.rows) {
    const std::string loc = nusc::table_path(cv.log, lg, "location");
    if (files.count(loc)) continue;
    files[loc] = {join_path(expansion, loc + ".json"), &lg};
    total += size_of_file(files[loc].first);
  }
  core::Progress progress("convert maps (KiB)", kib(total), cv.o.progress_interval_s);
  progress.update(0, fmt::format("{} location(s)", files.size()));
  for (const auto& [loc, f] : files) {
    const std::string what =
        fmt::format("{} location '{}'", where(cv.log, *f.second), core::clip(loc));
    cv.maps[loc] = nusc::load_map(f.first, what);
    done += size_of_file(f.first);
    progress.update(kib_read(done, total, cv.maps.size() == files.size()), core::clip(loc, 40));
  }
  cv.object_offset = static_cast<uint8_t>(1 + nusc::kMapLayers);
  core::log::info("convert nuscenes: map expansion layers of {} location(s) from '{}'",
                  cv.maps.size(), core::clip(expansion, 200));
}

// Each split's samples: scenes by name, each scene's samples in order.
std::map<std::string, std::vector<const json*> > plan_samples(const Converter& cv,
                                                              const Splits& splits) {
  const NuScenesConvertOptions& o = cv.o;
  const std::string default_split = o.version == "v1.0-test" ? "test" : "train";
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
      const auto it = splits.split_of.find(name);
      if (it == splits.split_of.end()) {
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
            "nuScenes: scene '{}': its samples' 'next' tokens form a loop at '{}'",
            core::clip(name), core::clip(tok));
      const json& s =
          cv.sample.at(tok, fmt::format("'{}' scene '{}'", cv.scene.file, core::clip(name)));
      by_split[split].push_back(&s);
      tok = str(cv.sample, s, "next");
    }
  }
  if (unlisted > 0)
    core::log::warn("convert nuscenes: {} scene(s) in no split of '{}' are not converted", unlisted,
                    core::clip(o.splits_file, 200));
  if (o.splits_file.empty()) {
    core::log::warn(
        "convert nuscenes: no --splits: every scene goes to split '{}' (docs/data.md: "
        "tools/nuscenes_splits.py writes the official train/val split file)",
        default_split);
  }
  return by_split;
}

// The stored image size (the first job's first camera) and the written one.
void image_sizes(Converter& cv, const Job& first) {
  const NuScenesConvertOptions& o = cv.o;
  const std::string tok = str(cv.sample, *first.sample, "token");
  const json& sd = cv.camera_data(tok, o.cameras.front());
  const std::string what =
      fmt::format("sample '{}' camera {}", core::clip(tok), core::clip(o.cameras.front()));
  const auto bytes = cv.read_image(sd, what);
  const std::string ctx =
      fmt::format("nuScenes: {}: image '{}'", what,
                  core::clip(join_path(o.dataroot, str(cv.sample_data, sd, "filename")), 300));
  const JpegSize js = jpeg_size(bytes.data(), bytes.size(), ctx);
  cv.stored_h = js.height;
  cv.stored_w = js.width;
  cv.height = o.height ? o.height : cv.stored_h;
  cv.width = o.width ? o.width : cv.stored_w;
  if (cv.height > cv.stored_h || cv.width > cv.stored_w || cv.height < 8 || cv.width < 8) {
    throw_error<UsageError>(
        "convert nuscenes: --image-size {} {}: the images are {} x {}; the "
        "size must be 8 or more and at most that (no upscaling)",
        cv.height, cv.width, cv.stored_h, cv.stored_w);
  }
  cv.passthrough = o.image_codec == "jpeg" && cv.height == cv.stored_h && cv.width == cv.stored_w;
}

// The options that decide the shards' contents, as recorded in convert.json.
std::string options_record(const Converter& cv, const std::string& classes_text,
                           const std::string& splits_text) {
  const NuScenesConvertOptions& o = cv.o;
  json j;
  j["dataroot"] = fs::weakly_canonical(o.dataroot).string();
  j["version"] = o.version;
  j["cameras"] = o.cameras;
  j["image_size"] = {cv.height, cv.width};
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

// The output folder, and what an earlier run with the same options left (convert.json).
void prepare_out(const NuScenesConvertOptions& o, const std::string& record) {
  const std::string out = core::clip(o.out, 200);
  std::error_code ec;
  fs::create_directories(o.out, ec);
  if (ec) throw_error<IoError>("cannot create output folder '{}': {}", out, ec.message());
  const std::string record_path = join_path(o.out, "convert.json");
  if (o.overwrite) {
    fs::remove(join_path(o.out, "dataset.json"), ec);
    fs::remove(record_path, ec);
    const std::regex shard_re(R"([A-Za-z0-9_-]+_\d{5}\.h5)");
    for (const auto& e : fs::directory_iterator(o.out, ec))
      if (std::regex_match(e.path().filename().string(), shard_re)) fs::remove(e.path(), ec);
  } else if (fs::exists(record_path)) {
    if (nusc::read_text(record_path) != record) {
      throw_error<UsageError>(
          "convert nuscenes: '{}' holds a conversion made with other options "
          "(its convert.json); pass the same options to resume it, or "
          "--overwrite to start again",
          out);
    }
  } else if (fs::exists(join_path(o.out, "dataset.json"))) {
    throw_error<UsageError>(
        "convert nuscenes: '{}' already holds a dataset; pass --overwrite to "
        "replace it",
        out);
  }
  for (const auto& e : fs::directory_iterator(o.out, ec)) {
    if (e.path().extension() == ".tmp") fs::remove(e.path(), ec);  // a killed run's partial shard
  }
  if (!fs::exists(record_path)) core::write_file_atomic(record_path, record);
}

DatasetInfo dataset_info(const Converter& cv,
                         const std::map<std::string, std::vector<const json*> >& by_split) {
  const NuScenesConvertOptions& o = cv.o;
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
  return info;
}

// Why kept shard `path` cannot stay ("" when it can): it must hold exactly scenes first.. of
// `tokens` (the samples this conversion gives them), each readable with its checksums (HDF5's
// Fletcher-32 on every chunk), shapes and labels as dataset.json says, JPEG images decoding (at
// 1/8: cheap, and any corrupt byte that passed the checksum still fails the decoder).
std::string kept_shard_problem(const std::string& path, const DatasetInfo& info, int64_t first,
                               const std::vector<std::string>& tokens) {
  try {
    const ShardReader r(path);
    const auto& idx = r.scene_indices();
    const auto n = static_cast<int64_t>(tokens.size());
    if (static_cast<int64_t>(idx.size()) != n || idx.front() != first ||
        idx.back() != first + n - 1)
      return fmt::format("it holds {} scenes, expected {} from {}", idx.size(), n,
                         scene_name(first));
    ShardReader::Selection sel;
    sel.decode_scale = info.image_codec == "jpeg" ? 8 : 1;
    for (int64_t i = 0; i < n; ++i) {
      r.read(first + i, info, sel);
      const std::string token = r.sample_meta(first + i).token;
      if (token != tokens[static_cast<size_t>(i)]) {
        return fmt::format("scene {} is sample '{}', expected '{}'", scene_name(first + i),
                           core::clip(token), core::clip(tokens[static_cast<size_t>(i)]));
      }
    }
  } catch (const Error& e) {
    return core::clip(e.what(), 300);
  }
  return "";
}

// Shards an earlier run completed (a resumed conversion) are kept when they verify; the others
// are removed, with a warning naming them, and converted again. Returns the kept ones.
std::set<std::string> keep_complete_shards(const Converter& cv, const DatasetInfo& info,
                                           const std::vector<Job>& jobs) {
  const NuScenesConvertOptions& o = cv.o;
  std::vector<std::pair<std::string, int64_t> > found;  // shard file, first job of it
  std::map<std::string, int64_t> split_start;           // split -> its first job
  for (size_t j = jobs.size(); j-- > 0;) split_start[jobs[j].split] = static_cast<int64_t>(j);
  for (const auto& [split, si] : info.splits) {
    for (size_t s = 0; s < si.shards.size(); ++s) {
      if (fs::exists(join_path(o.out, si.shards[s])))
        found.emplace_back(si.shards[s],
                           split_start.at(split) + static_cast<int64_t>(s) * o.shard_scenes);
    }
  }
  std::set<std::string> kept;
  if (found.empty()) return kept;
  core::Progress progress("convert verify kept shard", static_cast<int64_t>(found.size()),
                          o.progress_interval_s);
  progress.update(0);
  for (size_t i = 0; i < found.size(); ++i) {
    const auto& [shard, start] = found[i];
    const Job& head = jobs[static_cast<size_t>(start)];
    const SplitInfo& si = info.splits.at(head.split);
    const int64_t count = std::min(o.shard_scenes, si.scenes - head.index);
    std::vector<std::string> tokens;
    for (int64_t k = 0; k < count; ++k)
      tokens.push_back(str(cv.sample, *jobs[static_cast<size_t>(start + k)].sample, "token"));
    const std::string path = join_path(o.out, shard);
    const std::string problem = kept_shard_problem(path, info, head.index, tokens);
    if (problem.empty()) {
      kept.insert(shard);
    } else {
      core::log::warn(
          "convert nuscenes: kept shard '{}' fails verification ({}); converting it again",
          core::clip(path, 200), problem);
      std::error_code ec;
      fs::remove(path, ec);
    }
    progress.update(static_cast<int64_t>(i) + 1, shard);
  }
  return kept;
}

// Converts `todo` on the workers and writes them, in order, into their shards.
void write_shards(Converter& cv, const DatasetInfo& info, const std::vector<Job>& todo, int workers,
                  core::Progress& progress) {
  const NuScenesConvertOptions& o = cv.o;
  OrderedPool<SceneRecord> pool(static_cast<int64_t>(todo.size()), workers, [&](int64_t j) {
    const Job& job = todo[static_cast<size_t>(j)];
    SceneRecord r = cv.make(job);
    r.index = job.index;
    r.sequence = job.sequence;
    r.frame = job.frame;
    r.prev_index = job.prev_index;
    r.timestamp_us = std::llround(num(cv.sample, *job.sample, "timestamp"));
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

}  // namespace

NuScenesConvertSummary convert_nuscenes(const NuScenesConvertOptions& opts) {
  Converter cv;
  cv.o = opts;
  NuScenesConvertOptions& o = cv.o;
  if (o.cameras.empty()) o.cameras = nuscenes_cameras();
  check_convert_options(o);
  cv.dir = join_path(o.dataroot, o.version);
  check_version_folder(o, cv.dir);
  const std::string classes_text = nusc::read_classes(cv);

  core::Stopwatch clock;
  read_tables(cv);
  read_maps(cv);
  core::log::info(
      "convert nuscenes: {} tables read in {:.1f} s: {} scenes, {} samples, {} sample_data, {} "
      "annotations",
      o.version, clock.elapsed_s(), cv.scene.rows.size(), cv.sample.rows.size(),
      cv.sample_data.rows.size(), cv.annotation.rows.size());

  const Splits splits = nusc::read_splits(cv);
  const auto by_split = plan_samples(cv, splits);
  std::vector<Job> jobs;
  for (const auto& [split, samples] : by_split) {
    for (size_t i = 0; i < samples.size(); ++i) {
      Job job{split, static_cast<int64_t>(i), samples[i]};
      // A scene's samples are consecutive in the split: the previous keyframe is the previous
      // job exactly when the sample's 'prev' names it.
      if (i > 0 &&
          str(cv.sample, *samples[i], "prev") == str(cv.sample, *samples[i - 1], "token")) {
        job.sequence = jobs.back().sequence;
        job.frame = jobs.back().frame + 1;
        job.prev_index = static_cast<int64_t>(i) - 1;
      } else if (i > 0) {
        job.sequence = jobs.back().sequence + 1;
      }
      jobs.push_back(job);
    }
  }
  if (jobs.empty())
    throw_error<DataError>("nuScenes: '{}' holds no sample to convert", core::clip(cv.dir, 200));
  image_sizes(cv, jobs.front());
  prepare_out(o, options_record(cv, classes_text, splits.text));
  const DatasetInfo info = dataset_info(cv, by_split);

  const std::set<std::string> done = keep_complete_shards(cv, info, jobs);
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
                  cv.passthrough ? "source JPEG bytes" : o.image_codec, workers,
                  core::clip(o.out, 200));
  core::Progress progress("convert sample", static_cast<int64_t>(todo.size()),
                          o.progress_interval_s);
  write_shards(cv, info, todo, workers, progress);
  write_dataset_json(o.out, info);
  std::error_code ec;
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

#endif  // PARALLAX_WITH_NUSCENES

}  // namespace parallax::data
