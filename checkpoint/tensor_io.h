// Internal: writing one tensor as an HDF5 dataset in bounded blocks (with its crc32), and reading a
// whole dataset back into a tensor. Used by the rank files and by weights.h5.
#pragma once

#include "checkpoint/h5.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace parallax::checkpoint::tensor_io {

// A reusable host buffer for device -> host staging (pinned when the source is on a GPU).
class Staging {
 public:
  at::Tensor get(int64_t bytes, bool pinned);

 private:
  at::Tensor buf_;
};

// zlib crc32 of `n` bytes at `p`, continuing from `crc` (crc32_z semantics). With `parallel`,
// large buffers are split into chunks checksummed on ATen's intra-op threads and combined with
// crc32_combine (same result); background writers pass false so as not to compete with training.
uint32_t crc32_update(uint32_t crc, const void* p, int64_t n, bool parallel);

// Creates dataset `name` (intermediate groups created) in `loc` holding `tensor` (any device,
// any layout), written in C-order blocks of at most `block_bytes`, with a "dtype" attribute.
// Returns the zlib crc32 of the bytes written. Throws IoError naming `context`.
uint32_t write_dataset(hid_t loc, const std::string& name, const at::Tensor& tensor,
                       int64_t block_bytes, Staging& staging, const std::string& context,
                       bool parallel_crc = true);

// The whole dataset `name` of `loc` as a CPU tensor of its stored dtype (the "dtype" attribute,
// else inferred from the HDF5 type). Throws E naming `context`.
at::Tensor read_dataset(hid_t loc, const std::string& name, const std::string& context);

// The box of dataset `name` at `offsets` with `lengths` (one per dimension) as a CPU tensor of its
// stored dtype: an HDF5 hyperslab, so only the box is read. Throws CheckpointError naming
// `context` (also for a box outside the dataset).
at::Tensor read_dataset_box(hid_t loc, const std::string& name, const std::vector<int64_t>& offsets,
                            const std::vector<int64_t>& lengths, const std::string& context);

// The zlib crc32 of the bytes of dataset `name` as stored (C order; what write_dataset returned),
// streamed in blocks of at most `block_bytes`. Throws CheckpointError naming `context`.
uint32_t dataset_crc32(hid_t loc, const std::string& name, int64_t block_bytes,
                       const std::string& context);

// Stored dtype of dataset `dset` (attribute "dtype", else from the HDF5 type).
at::ScalarType dataset_dtype(hid_t dset, const std::string& context);

}  // namespace parallax::checkpoint::tensor_io
