// Reading checkpoints: whole tensors, or any box of a tensor under any layout (resharding).
//
// A rank asks for the boxes it needs under its own layout (name, offsets, lengths = the
// destination's sizes); the reader intersects each box with the saved shards and reads only the
// overlapping parts, with HDF5 hyperslab selections, straight into the destination when it is a
// contiguous CPU tensor of the saved dtype (else through one host buffer of the box's size). Saved
// flat ranges (format.h) are read as the boxes they cover: each box is a contiguous run of the
// shard's 1-D dataset, and its overlap with the asked box a strided selection of it. So a DP 4
// checkpoint loads on DP 2 or 1, a ZeRO rank's flat ranges of 4 reload as the ranges of 2 (or as
// whole tensors, or TP splits), a TP split along dim 1 reloads as any other split, and no rank
// reads more than its boxes (plus, with verification, the rest of shards it touched only in part:
// see ReadOptions::verify).
//
// Errors (CheckpointError, naming the checkpoint, the file and the tensor): no metadata.json, a
// metadata.json whose checksum does not match or whose step is not its directory's, a foreign or
// newer format version, a tensor missing, a dtype or shape that does not match the
// destination, a missing or truncated rank file, a dataset that is missing or of the wrong shape,
// a checksum mismatch (ChecksumError). load() checks everything it can without reading data (names,
// dtypes, shapes, files present with their recorded sizes, datasets present with their recorded
// shapes) before it writes into any destination; a checksum mismatch found while reading leaves the
// destinations read so far modified (the caller must not continue with them).
//
// Thread-safety: a reader is used by one thread at a time; separate readers may run concurrently.
#pragma once

#include "checkpoint/format.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace parallax::checkpoint {

struct ReadOptions {
  // Check each shard's crc32. A shard read whole is checked on the bytes just read (no extra I/O;
  // a flat shard counts as read whole when one load() reads each of its boxes whole, through any
  // number of targets); a shard read only in part is streamed whole once, in bounded blocks, to
  // check it.
  bool verify = true;
  // Convert to the destination's dtype (weights loading); otherwise dtypes must match exactly.
  bool allow_cast = false;
};

// One box to load: `dest` receives the box of tensor `name` that starts at `offsets` and has
// dest.sizes() as lengths. Empty `offsets`: `dest` is the whole tensor (its shape must equal the
// saved shape). `dest` may live on any device.
struct LoadTarget {
  std::string name;
  at::Tensor dest;
  std::vector<int64_t> offsets;
};

// The targets that fill `flat` (1-D) with elements [begin, begin + flat.numel()) of the C-order
// flattening of tensor `name` of `shape`: one box per part of the range (core::
// flat_range_boxes), each `dest` a view of the matching run of `flat`. A ZeRO rank loads its flat
// piece of a parameter's state with them, whatever layout saved it. Throws CheckpointError when
// `flat` is not 1-D or the range lies outside the tensor.
std::vector<LoadTarget> flat_load_targets(const std::string& name, const at::Tensor& flat,
                                          const std::vector<int64_t>& shape, int64_t begin);

// A tensor of the checkpoint that holds NaN or infinite values (CheckpointReader::verify_all).
struct NonFiniteTensor {
  std::string name;
  int64_t nan = 0;
  int64_t inf = 0;
  std::vector<std::string> files;  // the rank files of the shards that hold them
};

struct ReadStats {
  int64_t bytes_read = 0;      // tensor bytes read into destinations
  int64_t bytes_verified = 0;  // bytes checksummed (including extra verification reads)
  int64_t extra_bytes = 0;     // bytes read only to verify shards touched in part
};

class CheckpointReader {
 public:
  // `path`: a checkpoint directory, a checkpoints directory or a run directory (their `latest`).
  // Reads and validates metadata.json. `block_bytes` bounds the buffers of verification reads.
  explicit CheckpointReader(const std::string& path, int64_t block_bytes = 64 << 20);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& dir() const;
  const Metadata& metadata() const;
  bool contains(const std::string& name) const;
  // Throws CheckpointError (with a did-you-mean) when absent.
  const TensorInfo& info(const std::string& name) const;
  // Tensor names starting with `prefix`, sorted.
  std::vector<std::string> names(const std::string& prefix = "") const;

  // Loads every target (validated first, see the file comment), tensor by tensor.
  void load(const std::vector<LoadTarget>& targets, const ReadOptions& options = {});
  // One box into `dest` (empty `offsets`: the whole tensor).
  void read(const std::string& name, const at::Tensor& dest,
            const std::vector<int64_t>& offsets = {}, const ReadOptions& options = {});
  // The whole tensor as a new CPU tensor of its saved dtype.
  at::Tensor read(const std::string& name, const ReadOptions& options = {});

  // The resolved config the checkpoint was saved with (its config.yaml), or nullopt for
  // checkpoints saved without one. Throws CheckpointError when the file is missing or its size or
  // crc32 differs from metadata.json's record.
  std::optional<std::string> config_text();

  // Streams every shard (or those of tensors accepted by `filter`, and among them those accepted
  // by `shard_filter`) and checks its crc32 and its file, and config.yaml; throws CheckpointError
  // at the first problem (ChecksumError, checkpoint/checksum_error.h, for a crc32 mismatch).
  // Returns the bytes verified. With `nonfinite`, also counts the NaN and infinite values of
  // floating tensors on the bytes read (no extra I/O) and appends one record per tensor that has
  // any, in name order.
  int64_t verify_all(const std::function<bool(const TensorInfo&)>& filter = nullptr,
                     std::vector<NonFiniteTensor>* nonfinite = nullptr,
                     const std::function<bool(const ShardInfo&)>& shard_filter = nullptr);

  const ReadStats& stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace parallax::checkpoint
