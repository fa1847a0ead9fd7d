// `parallax datagen`: writes a synthetic dataset (docs/data.md) of procedurally generated,
// ray-cast scenes with exact labels.
//
// Scenes are generated on a pool of std::threads (one whole scene per task) and written in index
// order by the calling thread, so the files are bitwise identical for a seed whatever the thread
// count. The train and val splits use different seeds derived from the dataset seed. Shards are
// renamed into place when complete and dataset.json is written last, so a folder with a
// dataset.json is a complete dataset. Errors in worker threads are rethrown in the caller.
#pragma once

#include "data/scene_gen.h"
#include "data/schema.h"

#include <cstdint>
#include <string>

namespace parallax::data {

// One generated scene; `instance` int32 [N, H, W] and `depth` float32 [N, H, W] (see render.h) are
// defined only when requested.
struct GeneratedScene {
  SceneRecord record;
  at::Tensor instance, depth;
  SceneLayout layout;
};

GeneratedScene generate_scene(const GeneratorOptions& opts, uint64_t split_seed, int64_t index,
                              bool with_buffers = false);

// The base seed of split `split` ("train", "val") of a dataset generated with `seed`.
uint64_t split_seed(uint64_t seed, const std::string& split);

struct DatagenOptions {
  std::string out;
  int64_t train_scenes = 1000;
  int64_t val_scenes = 100;
  GeneratorOptions gen;
  uint64_t seed = 0;
  int64_t shard_scenes = 250;       // scenes per shard
  int threads = 0;                  // 0: std::thread::hardware_concurrency()
  int compression = 1;              // deflate level of images and BEV labels (0..9)
  std::string image_codec = "raw";  // "raw" pixels or "jpeg" bytes in the shards
  int jpeg_quality = 95;            // with image_codec "jpeg": 1..100
  bool overwrite = false;           // replace an existing dataset in `out`
  double progress_interval_s = 5.0;
};

struct DatagenSummary {
  DatasetInfo info;
  double seconds = 0;
  int64_t bytes = 0;  // total size of the shards
};

// Generates the dataset. Throws UsageError for bad options (or an existing dataset without
// `overwrite`), IoError for filesystem problems, DataError for HDF5 failures.
DatagenSummary generate_dataset(const DatagenOptions& opts);

}  // namespace parallax::data
