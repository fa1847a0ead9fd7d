// `parallax inspect` for checkpoints: a human-readable summary (step, layout, config hash, files,
// extra scalars, every tensor with dtype, shape, shards and size) and, optionally, verification of
// every shard (file present and of its recorded size, dataset shape, crc32, no NaN or infinity)
// and of config.yaml. metadata.json's own checksum is checked whenever the checkpoint is opened.
#pragma once

#include <ostream>
#include <string>

namespace parallax::checkpoint {

struct InspectOptions {
  bool verify = true;        // stream every shard and check its checksum
  bool list_tensors = true;  // one line per tensor
  bool list_shards = false;  // and one line per shard under it
};

// `path`: a checkpoint directory, a checkpoints directory or a run directory (their `latest`).
// Prints to `out`; throws CheckpointError naming the file and tensor on corruption, and naming
// every tensor that holds NaN or infinite values (after printing the summary and a "NOT OK"
// verdict). Returns the checkpoint directory inspected.
std::string inspect(const std::string& path, std::ostream& out, const InspectOptions& options = {});
inline std::string inspect(const std::string& path, std::ostream& out, bool verify) {
  InspectOptions o;
  o.verify = verify;
  return inspect(path, out, o);
}

}  // namespace parallax::checkpoint
