// `parallax convert nuscenes`: a nuScenes folder into a Parallax dataset (data/nuscenes.h).
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/strings.h"
#include "data/nuscenes.h"
#include "launch/args.h"
#include "launch/verbs.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <regex>
#include <tuple>
#include <utility>

namespace parallax::launch {

namespace {

// `--image-size H W` (joined as "HxW" by verb_convert): each side in 8..kNuScenesMaxImageSide.
std::pair<int64_t, int64_t> convert_image_size(const std::string& v) {
  std::smatch m;
  if (!std::regex_match(v, m, std::regex(R"((\d+)[x ,](\d+))")))
    throw_error<UsageError>(
        "convert: --image-size takes a height and a width (e.g. --image-size 256 704), got '{}'",
        core::clip(v));
  // Digits beyond the limit's are out of range whatever their value (no stoll overflow).
  const std::string h = m[1], w = m[2];
  auto side = [](const std::string& d) -> int64_t {
    return d.size() > 6 ? data::kNuScenesMaxImageSide + 1 : std::stoll(d);
  };
  const int64_t height = side(h), width = side(w);
  if (height < 8 || width < 8 || height > data::kNuScenesMaxImageSide ||
      width > data::kNuScenesMaxImageSide) {
    throw_error<UsageError>(
        "convert: --image-size {} {} is out of range: the height and the width must be in 8..{}",
        core::clip(h, 20), core::clip(w, 20), data::kNuScenesMaxImageSide);
  }
  return {height, width};
}

}  // namespace

int verb_convert(const std::vector<std::string>& argv_in) {
  // `--image-size H W` takes two values: joined into one ("HxW") for the option parser.
  std::vector<std::string> argv;
  for (size_t i = 0; i < argv_in.size(); ++i) {
    if (argv_in[i] == "--image-size" && i + 2 < argv_in.size() &&
        argv_in[i + 2].rfind("--", 0) != 0) {
      argv.push_back(argv_in[i]);
      argv.push_back(argv_in[i + 1] + "x" + argv_in[i + 2]);
      i += 2;
    } else {
      argv.push_back(argv_in[i]);
    }
  }
  Args args("convert",
            "Convert a driving dataset into a Parallax dataset (dataset.json + HDF5 shards; "
            "docs/data.md, \"nuScenes\"). Formats: nuscenes. Resumable: rerun the same command "
            "after an interruption and the complete shards are kept.");
  args.positional("format", "the source format: nuscenes")
      .option("dataroot", "DIR", "the nuScenes folder (holding v1.0-*/ and samples/)")
      .option("version", "V", "v1.0-mini, v1.0-trainval or v1.0-test", "v1.0-mini")
      .option("out", "DIR", "output folder (created; holds dataset.json, the shards, convert.json)")
      .option("cameras", "LIST",
              "comma-separated camera channels, in the order the model sees them (default: the "
              "six, counter-clockwise from CAM_FRONT)")
      .option("image-size", "H W",
              "stored image size, each side 8..4096 (default: the source's; at most it)")
      .option("image-codec", "C", "jpeg (the source's bytes when the size is kept) or raw", "jpeg")
      .option("quality", "Q", "JPEG quality 1..100 when images are re-encoded (resized)", "95")
      .option("workers", "N", "conversion threads (0: all cores)", "0")
      .option("classes", "FILE",
              "YAML/JSON {category: class} (default: the 10 nuScenes detection classes)")
      .option("splits", "FILE",
              "YAML/JSON {split: [scene names]} (default: every scene in one split; "
              "tools/nuscenes_splits.py writes the official train/val file)")
      .option("ego-x-offset", "M",
              "metres from nuScenes' ego origin (the rear axle) forward to the stored ego origin",
              "0")
      .option("bev-range", "R", "BEV grid half-extent in metres", "50")
      .option("bev-resolution", "M", "BEV cell size in metres", "0.5")
      .option("shard-scenes", "K", "samples per HDF5 shard", "250")
      .option("compression", "L", "deflate level 0..9 of raw images and BEV labels", "1")
      .flag("overwrite", "replace what --out holds");
  args.epilog(
      "examples:\n"
      "  parallax convert nuscenes --dataroot /data/nuscenes --version v1.0-mini --out "
      "datasets/nusc_mini\n"
      "  parallax convert nuscenes --dataroot /data/nuscenes --version v1.0-trainval --splits "
      "splits.json --image-size 256 704 --out datasets/nusc");
  args.parse(argv);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  const std::string format = args.positional_value();
  if (format != "nuscenes") {
    throw_error<UsageError>("convert: unknown format '{}'; formats: nuscenes", core::clip(format));
  }
  for (const char* req : {"dataroot", "out"}) {
    if (!args.has(req))
      throw_error<UsageError>("convert: --{} is required; see 'parallax convert --help'", req);
  }
  data::NuScenesConvertOptions o;
  o.dataroot = args.get("dataroot");
  o.version = args.get("version");
  o.out = args.get("out");
  core::check_output_dir("convert: --out", o.out);  // a folder or new (core/files.h)
  if (args.has("cameras")) o.cameras = core::split(args.get("cameras"), ',');
  for (const auto& c : o.cameras) {
    if (c.empty())
      throw_error<UsageError>("convert: --cameras '{}' holds an empty name",
                              core::clip(args.get("cameras")));
  }
  if (args.has("image-size"))
    std::tie(o.height, o.width) = convert_image_size(args.get("image-size"));
  o.image_codec = args.get("image-codec");
  o.quality = static_cast<int>(args.get_int("quality", 1, 100));
  o.workers = static_cast<int>(args.get_int("workers", 0, 1024));
  if (args.has("classes")) o.classes_file = args.get("classes");
  if (args.has("splits")) o.splits_file = args.get("splits");
  o.ego_x_offset = args.get_double("ego-x-offset", -10, 10, false);
  const double range = args.get_double("bev-range", 0, 1e4, true),
               res = args.get_double("bev-resolution", 0, 1e4, true);
  const double cells = 2 * range / res;
  if (std::abs(cells - std::round(cells)) > 1e-6 || cells > 4096) {
    throw_error<UsageError>(
        "convert: --bev-range {} must be a whole number of --bev-resolution {} cells (x2), at most "
        "4096 a side",
        range, res);
  }
  o.bev = {-range, range, -range, range, res};
  o.shard_scenes = args.get_int("shard-scenes", 1, 1 << 22);
  o.compression = static_cast<int>(args.get_int("compression", 0, 9));
  o.overwrite = args.flag_set("overwrite");
  const data::NuScenesConvertSummary s = data::convert_nuscenes(o);
  std::string ignored;
  for (const auto& [name, n] : s.ignored_categories)
    ignored += fmt::format("{}{} {}", ignored.empty() ? "" : ", ", core::clip(name), n);
  core::log::info(
      "convert: wrote {} ({} samples, {} boxes; {} boxes of unmapped categories ignored{}{}; {} "
      "shard(s) kept from an earlier run) in {:.1f} s",
      core::clip(o.out, 200), s.samples, s.boxes, s.ignored_boxes, ignored.empty() ? "" : ": ",
      core::clip(ignored, 2000), s.shards_kept, s.seconds);
  return 0;
}

}  // namespace parallax::launch
