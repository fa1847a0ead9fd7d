// `parallax datagen`: generate a synthetic multi-camera dataset (data/datagen.h).
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "data/datagen.h"
#include "launch/args.h"
#include "launch/verbs.h"

#include <fmt/format.h>

#include <cstdio>

namespace parallax::launch {

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
      .option("bev-range", "R", "BEV grid half-extent in metres: x and y in [-R, R)", "25")
      .option("bev-resolution", "M", "BEV cell size in metres", "0.5")
      .option("samples-per-pixel", "S", "rays per pixel: 1 (fast) or 4 (anti-aliased)", "4")
      .flag("overwrite", "replace a dataset already in --out")
      .epilog(
          "examples:\n"
          "  parallax datagen --out datasets/synth --scenes 1000 --val-scenes 100\n"
          "  parallax datagen --out /tmp/tiny --scenes 16 --cameras 4 --height 64 --width 112 "
          "--threads 2");
  args.parse(argv);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  if (!args.has("out"))
    throw_error<UsageError>("datagen: --out DIR is required; see 'parallax datagen --help'");
  data::DatagenOptions o;
  o.out = args.get("out");
  o.train_scenes = args.get_int("scenes");
  o.val_scenes = args.has("val-scenes") ? args.get_int("val-scenes")
                                        : std::max<int64_t>(1, (o.train_scenes + 9) / 10);
  o.gen.cameras = static_cast<int>(args.get_int("cameras"));
  o.gen.height = static_cast<int>(args.get_int("height"));
  o.gen.width = static_cast<int>(args.get_int("width"));
  o.gen.samples_per_pixel = static_cast<int>(args.get_int("samples-per-pixel"));
  if (o.gen.samples_per_pixel != 1 && o.gen.samples_per_pixel != 4) {
    throw_error<UsageError>("datagen: --samples-per-pixel must be 1 or 4, got {}",
                            o.gen.samples_per_pixel);
  }
  const double range = args.get_double("bev-range"), res = args.get_double("bev-resolution");
  if (!(range > 0) || !(res > 0) ||
      std::abs(2 * range / res - std::round(2 * range / res)) > 1e-6) {
    throw_error<UsageError>(
        "datagen: --bev-range {} must be a positive whole number of --bev-resolution {} cells (x2)",
        range, res);
  }
  o.gen.bev = {-range, range, -range, range, res};
  const int64_t seed = args.get_int("seed");
  if (seed < 0) throw_error<UsageError>("datagen: --seed must be >= 0, got {}", seed);
  o.seed = static_cast<uint64_t>(seed);
  o.shard_scenes = args.get_int("shard-scenes");
  o.threads = static_cast<int>(args.get_int("threads"));
  o.compression = static_cast<int>(args.get_int("compression"));
  o.overwrite = args.flag_set("overwrite");
  const data::DatagenSummary s = data::generate_dataset(o);
  core::log::info("datagen: wrote {} ({} train + {} val scenes, {}) in {:.1f} s ({:.2f} scenes/s)",
                  o.out, o.train_scenes, o.val_scenes,
                  core::human_bytes(static_cast<double>(s.bytes)), s.seconds,
                  static_cast<double>(o.train_scenes + o.val_scenes) / std::max(1e-9, s.seconds));
  return 0;
}

}  // namespace parallax::launch
