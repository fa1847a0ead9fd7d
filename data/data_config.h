// The `data` config section: where the dataset lives and how it is loaded.
#pragma once

#include "core/config.h"

#include <string>

namespace parallax::data {

struct DataConfig {
  std::string path = "datasets/synth";
  bool synthetic = false;  // in-memory random batches (benchmark mode): no files read
  int batch_size = 2;      // per data-parallel rank
  int num_workers = 2;
  int prefetch = 4;
  bool shuffle = true;
  bool drop_last = true;
  bool augment = true;

  template <class V>
  void visit(V& v) {
    v("path", path, "dataset folder (HDF5 shards + dataset.json)");
    v("synthetic", synthetic, "random in-memory batches of the right shapes (benchmarks; no I/O)");
    v("batch_size", batch_size, "samples per step on each data-parallel rank", core::Check::at_least(1));
    v("num_workers", num_workers, "loader threads reading and decoding ahead", core::Check::at_least(0));
    v("prefetch", prefetch, "batches kept ready ahead of the trainer", core::Check::at_least(1));
    v("shuffle", shuffle, "reshuffle every epoch (deterministic by seed and epoch)");
    v("drop_last", drop_last, "drop the last incomplete batch of an epoch");
    v("augment", augment, "photometric and geometric augmentation (train split only)");
  }
};

}  // namespace parallax::data
