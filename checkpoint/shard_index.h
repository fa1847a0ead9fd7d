// The shard index of one rank's file: what a rank publishes to rank 0 through the store once its
// file is durable (every tensor piece it wrote: name, dtype, global shape, box or flat range,
// crc32), and rank 0 folds into metadata.json at the commit. A line format, cheap to parse for
// thousands of shards; it lives only in the store for the duration of one save, so it is not part
// of the on-disk format (format.h) and carries its own version line.
//
// Errors: RankIndex::parse throws CheckpointError naming the rank on any malformed line.
#pragma once

#include "checkpoint/format.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace parallax::checkpoint {

// One piece of a tensor in a rank's file.
struct ShardRecord {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape, offsets, lengths;  // a box's offsets and lengths
  uint32_t crc32 = 0;
  std::optional<FlatRange> flat;  // or a flat range (offsets, lengths empty)
  int piece = 0;                  // this file's k-th piece of the tensor (format.h)
};

struct RankIndex {
  int rank = 0;
  std::string file;   // the file's name inside the checkpoint directory
  int64_t bytes = 0;  // the file's size
  std::vector<ShardRecord> shards;

  // The line format (the name last, so it may hold spaces):
  //   parallax-shard-index 3
  //   file <file> <rank> <bytes>
  //   shard <crc32> <piece> <dtype> <ndim> <shape...> <offsets...> <lengths...> <name>   a box
  //   flat <crc32> <piece> <dtype> <ndim> <shape...> <begin> <end> <name>     a flat range
  std::string serialize() const;
  // The inverse of serialize(); `from_rank` names the sender in errors.
  static RankIndex parse(const std::string& text, int from_rank);
};

}  // namespace parallax::checkpoint
