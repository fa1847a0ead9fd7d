// `parallax inspect <path>`: describe and verify what is at a path: a dataset folder, a data shard,
// or a checkpoint (a step directory, a checkpoints directory with `latest`, or a run directory).
#include "checkpoint/format.h"
#include "checkpoint/inspect.h"
#include "core/error.h"
#include "data/inspect.h"
#include "data/shard.h"
#include "launch/args.h"
#include "launch/verbs.h"

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>

namespace fs = std::filesystem;

namespace parallax::launch {
namespace {

enum class PathKind { kDataset, kDataShard, kCheckpoint, kUnknown };

PathKind path_kind_of(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    if (fs::exists(fs::path(path) / "dataset.json", ec)) return PathKind::kDataset;
    if (checkpoint::is_checkpoint_path(path)) return PathKind::kCheckpoint;
    return PathKind::kUnknown;
  }
  if (fs::is_regular_file(path, ec) && data::is_data_shard(path)) return PathKind::kDataShard;
  // The `latest` pointer of a checkpoints directory (checkpoint::resolve_checkpoint reads it).
  if (checkpoint::is_checkpoint_path(path)) return PathKind::kCheckpoint;
  return PathKind::kUnknown;
}

}  // namespace

int verb_inspect(const std::vector<std::string>& argv) {
  Args args("inspect",
            "Describe and verify a dataset folder (dataset.json + HDF5 shards), one data shard "
            "(.h5) or a "
            "checkpoint. Datasets: metadata, splits, scene counts, per-scene shapes and class "
            "histograms; "
            "every scene is read and checked. Checkpoints: step, layout, tensors and sizes; "
            "metadata.json's "
            "own checksum and every shard's checksum are verified, and tensors holding NaN or "
            "infinity are "
            "listed and make the verdict NOT OK (non-zero exit). The first bad item ends it with "
            "an error "
            "naming the file and the scene or tensor.");
  args.positional("path",
                  "a dataset folder, a data shard (.h5), or a checkpoint (step directory, "
                  "checkpoints directory, its latest file, or run directory)")
      .flag("quick",
            "skip reading every scene / verifying checksums and finiteness (metadata and shapes "
            "only)")
      .flag("shards",
            "checkpoints: also list every shard of every tensor (its rank file, its box or flat "
            "range, its crc32)")
      .option("scene-lines", "N",
              "per-scene shape lines to print: a shard's, or each split's first shard's (0: none)",
              "10")
      .epilog(
          "examples:\n"
          "  parallax inspect datasets/synth\n"
          "  parallax inspect datasets/synth/val_00000.h5 --scene-lines 100\n"
          "  parallax inspect runs/bev_tiny            # its latest checkpoint\n"
          "  parallax inspect runs/bev_tiny --shards   # and where each piece of each tensor is");
  args.parse(argv);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  const std::string path = args.positional_value();
  data::InspectOptions opts;
  opts.verify = !args.flag_set("quick");
  opts.max_scene_lines =
      args.get_int("scene-lines", 0, std::numeric_limits<int64_t>::max(), "0 prints none");
  std::error_code ec;
  if (!fs::exists(path, ec)) throw_error<UsageError>("inspect: '{}' does not exist", path);
  switch (path_kind_of(path)) {
    case PathKind::kDataset:
      data::inspect_dataset(path, stdout, opts);
      return 0;
    case PathKind::kDataShard:
      data::inspect_shard(path, stdout, opts);
      return 0;
    case PathKind::kCheckpoint: {
      checkpoint::InspectOptions copts;
      copts.verify = opts.verify;
      copts.list_shards = args.flag_set("shards");
      checkpoint::inspect(path, std::cout, copts);
      return 0;
    }
    case PathKind::kUnknown:
      break;
  }
  throw_error<UsageError>(
      "inspect: cannot tell what '{}' is: expected a dataset folder (with dataset.json), a data "
      "shard (an HDF5 file with /scenes) or a checkpoint (with metadata.json or latest)",
      path);
}

}  // namespace parallax::launch
