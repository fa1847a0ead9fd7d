// `parallax datagen`: generate a synthetic multi-camera dataset (data/datagen.h).
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/strings.h"
#include "data/datagen.h"
#include "data/nuscenes.h"
#include "launch/args.h"
#include "launch/verbs.h"

#include <fmt/format.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <thread>

namespace parallax::launch {

namespace {

// Scenes per split: the generator lists every scene's job before rendering (~50 bytes each);
// 2^22 is 100x nuScenes' 40k key frames.
constexpr int64_t kMaxScenes = 1 << 22;
// Pixels per image side, and BEV cells per grid side.
constexpr int64_t kMaxPixels = 4096;
// Render threads.
constexpr int64_t kMaxThreads = 1024;
// Seconds between a sequence's frames: an hour (sequence times stay far inside int64 us).
constexpr double kMaxFrameInterval = 3600;

}  // namespace

int verb_datagen(const std::vector<std::string>& argv) {
  Args args("datagen",
            "Generate a synthetic dataset: procedural road scenes (lanes, markings, sidewalks, "
            "buildings; "
            "vehicles, pedestrians, cyclists) ray-cast into a surround camera rig, with exact BEV "
            "semantics "
            "and 3D boxes (docs/data.md). The same seed gives bitwise identical files for any "
            "--threads.");
  args.option("out", "DIR", "output folder (created; holds dataset.json and the HDF5 shards)")
      .option("scenes", "N", "train scenes", "1000")
      .option("val-scenes", "M", "val scenes (default: scenes / 10, at least 1)")
      .option("cameras", "N", "cameras of the surround rig", "6")
      .option("height", "H", "image height in pixels", "128")
      .option("width", "W", "image width in pixels", "224")
      .option("seed", "S", "dataset seed (train and val derive their own seeds from it)", "0")
      .option("shard-scenes", "K", "scenes per HDF5 shard", "250")
      .option("threads", "T", "render threads (0: all cores)", "0")
      .option("compression", "L", "deflate level 0..9 of images and BEV labels (0: none)", "1")
      .option("image-codec", "C", "how shards store images: raw (uint8 pixels) or jpeg", "raw")
      .option("quality", "Q", "JPEG quality 1..100 with --image-codec jpeg", "95")
      .option("bev-range", "R", "BEV grid half-extent in metres: x and y in [-R, R)", "25")
      .option("bev-resolution", "M", "BEV cell size in metres", "0.5")
      .option("samples-per-pixel", "S", "rays per pixel: 1 (fast) or 4 (anti-aliased)", "4")
      .option("layout", "L",
              "parallax (dataset.json + HDF5 shards) or nuscenes (the nuScenes on-disk layout: "
              "v1.0 JSON tables and JPEG files, for `parallax convert nuscenes`)",
              "parallax")
      .option("version", "V", "with --layout nuscenes: the version folder", "v1.0-mini")
      .option("samples-per-scene", "K", "with --layout nuscenes: keyframe samples per scene", "4")
      .option("sequence-length", "L",
              "frames per driving sequence: scene i is frame i % L of sequence i / L, one world "
              "seen as the ego and the objects move (the last sequence of a split may be "
              "shorter); 1: independent scenes",
              "1")
      .option("frame-interval", "S",
              "seconds between the frames of a sequence (nuScenes keyframes: 0.5)", "0.5")
      .flag("overwrite", "replace a dataset already in --out")
      .epilog(
          "examples:\n"
          "  parallax datagen --out datasets/synth --scenes 1000 --val-scenes 100\n"
          "  parallax datagen --out /tmp/tiny --scenes 16 --cameras 4 --height 64 --width 112 "
          "--threads 2\n"
          "  parallax datagen --out datasets/seq --scenes 400 --sequence-length 8 --frame-interval "
          "0.5");
  args.parse(argv);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  if (!args.has("out"))
    throw_error<UsageError>("datagen: --out DIR is required; see 'parallax datagen --help'");
  // Every integer through a range before any cast to int (a cast turned --height 4294967424 into
  // 128), and every size bounded before anything is allocated (docs/data.md, "Limits").
  data::DatagenOptions o;
  o.out = args.get("out");
  core::check_output_dir("datagen: --out", o.out);  // a folder or new (core/files.h)
  const std::string jobs = "every scene's job is listed up front";
  o.train_scenes = args.get_int("scenes", 1, kMaxScenes, jobs);
  o.val_scenes = args.has("val-scenes") ? args.get_int("val-scenes", 0, kMaxScenes, jobs)
                                        : std::max<int64_t>(1, (o.train_scenes + 9) / 10);
  o.gen.cameras = static_cast<int>(args.get_int("cameras", 1, 16));
  o.gen.height = static_cast<int>(args.get_int("height", 8, kMaxPixels));
  o.gen.width = static_cast<int>(args.get_int("width", 8, kMaxPixels));
  o.gen.samples_per_pixel = static_cast<int>(args.get_int("samples-per-pixel", 1, 4));
  if (o.gen.samples_per_pixel != 1 && o.gen.samples_per_pixel != 4) {
    throw_error<UsageError>("datagen: --samples-per-pixel must be 1 or 4, got {}",
                            o.gen.samples_per_pixel);
  }
  const double range = args.get_double("bev-range", 0, 1e4, true),
               res = args.get_double("bev-resolution", 0, 1e4, true);
  const double cells = 2 * range / res;
  if (std::abs(cells - std::round(cells)) > 1e-6) {
    throw_error<UsageError>(
        "datagen: --bev-range {} must be a positive whole number of --bev-resolution {} cells (x2)",
        range, res);
  }
  if (cells > kMaxPixels) {
    throw_error<UsageError>(
        "datagen: --bev-range {} / --bev-resolution {} gives a BEV grid of {:.0f} x {:.0f} cells; "
        "at most {} per side (as images)",
        range, res, cells, cells, kMaxPixels);
  }
  o.gen.bev = {-range, range, -range, range, res};
  o.seed = static_cast<uint64_t>(args.get_int("seed", 0, std::numeric_limits<int64_t>::max()));
  o.shard_scenes = args.get_int("shard-scenes", 1, kMaxScenes);
  o.threads = static_cast<int>(args.get_int(
      "threads", 0, kMaxThreads, "each render thread is an OS thread holding up to two scenes"));
  o.compression = static_cast<int>(args.get_int("compression", 0, 9));
  o.image_codec = args.get("image-codec");
  o.jpeg_quality = static_cast<int>(args.get_int("quality", 1, 100));
  o.overwrite = args.flag_set("overwrite");
  o.gen.sequence_length = args.get_int("sequence-length", 1, kMaxScenes);
  // Whole microseconds (the stored timestamps' unit), so the motion is evaluated at exactly the
  // stored times.
  const double interval = args.get_double("frame-interval", 0, kMaxFrameInterval, true);
  o.gen.frame_interval_us = std::llround(interval * 1e6);
  if (o.gen.frame_interval_us < 1) {
    throw_error<UsageError>(
        "datagen: --frame-interval {} s is less than 1 microsecond (timestamps are in us)",
        interval);
  }
  // Memory: the generator keeps up to 2 scenes per thread in flight (rendered, not yet written),
  // each of cameras x H x W x 3 image bytes and the BEV grid's cells; they must fit in this
  // machine's memory.
  const int threads = o.threads > 0
                          ? o.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const double scene_bytes = 3.0 * o.gen.cameras * o.gen.height * o.gen.width + cells * cells;
  const double in_flight = 2.0 * threads * scene_bytes;
  const double memory = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                        static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  if (memory > 0 && in_flight > memory) {
    throw_error<UsageError>(
        "datagen: --threads {} x 2 scenes in flight x {} per scene ({} cameras of {} x {}) = {}, "
        "more than this machine's {} of memory; use fewer --threads or smaller images",
        threads, core::human_bytes(scene_bytes), o.gen.cameras, o.gen.height, o.gen.width,
        core::human_bytes(in_flight), core::human_bytes(memory));
  }
  const std::string layout = args.get("layout");
  if (layout == "nuscenes") {
    // A sequence is one nuScenes scene: its samples are the sequence's frames.
    if (o.gen.sequence_length > 1 && args.has("samples-per-scene") &&
        args.get_int("samples-per-scene") != o.gen.sequence_length) {
      throw_error<UsageError>(
          "datagen: --samples-per-scene {} with --sequence-length {}: each sequence is one "
          "nuScenes "
          "scene of its frames (leave --samples-per-scene out)",
          args.get_int("samples-per-scene"), o.gen.sequence_length);
    }
    data::NuScenesLayoutOptions lo;
    lo.datagen = o;
    lo.version = args.get("version");
    lo.samples_per_scene = args.get_int("samples-per-scene", 1, kMaxScenes);
    data::write_nuscenes_layout(lo);
    return 0;
  }
  if (layout != "parallax")
    throw_error<UsageError>("datagen: --layout must be parallax or nuscenes, got '{}'", layout);
  const data::DatagenSummary s = data::generate_dataset(o);
  core::log::info("datagen: wrote {} ({} train + {} val scenes, {}) in {:.1f} s ({:.2f} scenes/s)",
                  o.out, o.train_scenes, o.val_scenes,
                  core::human_bytes(static_cast<double>(s.bytes)), s.seconds,
                  static_cast<double>(o.train_scenes + o.val_scenes) / std::max(1e-9, s.seconds));
  return 0;
}

}  // namespace parallax::launch
