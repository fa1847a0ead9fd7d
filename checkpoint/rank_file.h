// Internal: one rank's file of a save. Writes the entries this rank owns into `rank_XXXXX.h5`
// (format.h: one dataset per piece, with its offsets or flat range and the global shape as
// attributes), streaming each tensor in blocks of at most `block_bytes`, then fsyncs the file, and
// returns the shard index that rank 0 folds into metadata.json.
//
// Errors: IoError naming the rank and the file (cannot create, write, close: a full disk often
// surfaces at the close). A failed write leaves a partial file; the caller removes the directory.
#pragma once

#include "checkpoint/save_state.h"
#include "checkpoint/shard_index.h"
#include "checkpoint/tensor_io.h"

#include <cstdint>
#include <string>
#include <vector>

namespace parallax::checkpoint {

// Writes `entries` to `path` (replacing it) as rank `rank`'s file; `data_bytes` receives the
// tensor bytes written. `staging` is the device -> host buffer reused across calls;
// `parallel_crc` lets the checksums use ATen's intra-op threads (sync saves only: a background
// writer leaves the cores to training).
RankIndex write_rank_file(const std::string& path, int rank, const std::vector<OwnedEntry>& entries,
                          int64_t block_bytes, tensor_io::Staging& staging, int64_t& data_bytes,
                          bool parallel_crc);

}  // namespace parallax::checkpoint
