// Foreign tensor files, read-only: safetensors (one file, a sharded set with its index.json, or a
// Hugging Face model directory) and torch.save zip files, seen as one sorted list of named tensors.
// Pretrained weights come in these formats; checkpoints of our own stay in HDF5 (reader.h).
//
// Everything a reader may trust is validated when the file is opened (header bounds, offsets,
// dtypes, pickle globals, storage records), so that open_tensor_source either returns a source
// whose every tensor reads, or throws naming the file (and the tensor) at fault: nothing is
// half-read. The format details and limits are in docs/checkpoints.md ("Foreign weight files").
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace parallax::checkpoint {

// One tensor a file holds.
struct SourceTensor {
  std::string name;  // its key in the file (torch.save nested dicts: keys joined by '.')
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

// Read-only named tensors of a foreign file. Thread-safety: none (one thread at a time).
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  // Every tensor, sorted by name. Names are unique (a duplicate is refused when opening).
  virtual const std::vector<SourceTensor>& tensors() const = 0;
  // Tensor `name` as a CPU tensor of the listed dtype and shape.
  //  - safetensors: a view of the memory-mapped file, no copy. The tensor's deleter keeps the
  //    mapping alive (it outlives the source if the tensor does). The memory is read-only (writing
  //    into it faults) and may be unaligned for the dtype (safetensors does not align data): copy
  //    before writing or handing it to kernels that need alignment (copy_ into a parameter is
  //    fine).
  //  - torch.save: read from the zip record of its storage when asked (one storage in memory at a
  //    time); a tensor that is a view of part of a shared storage comes back as a contiguous copy.
  // CheckpointError naming the file and the tensor for an unknown name; IoError if reading fails.
  virtual at::Tensor read(const std::string& name) = 0;
  virtual std::string path() const = 0;    // for messages
  virtual std::string format() const = 0;  // "safetensors" | "torch.save"
  // File-level metadata (safetensors "__metadata__"; a sharded set: the index's "metadata", values
  // that are not strings as their JSON text), empty for torch.save.
  virtual std::map<std::string, std::string> metadata() const { return {}; }
};

// True when `path` is one of: a *.safetensors file, a *.safetensors.index.json (sharded set), a
// directory holding model.safetensors or model.safetensors.index.json (Hugging Face layout), a
// torch.save zip file (*.pt, *.pth, *.bin, *.ckpt, or any file starting with the zip magic
// "PK\x03\x04" that holds a data.pkl). Decided by name and magic bytes; nothing is validated.
bool is_tensor_source(const std::string& path);

// Opens it (a directory: model.safetensors if present, else model.safetensors.index.json).
// Errors: IoError (cannot open or read) or CheckpointError (corrupt or refused), the message naming
// the file and what is wrong (and the tensor, where one is at fault).
std::unique_ptr<TensorSource> open_tensor_source(const std::string& path);

// Writes one .safetensors file in the Hugging Face format: 8-byte little-endian header length, a
// JSON header with "__metadata__" (string -> string) and per tensor {"dtype", "shape",
// "data_offsets"}, padded with spaces to a multiple of 8, then the raw little-endian data with the
// tensors laid out in name order. Each tensor is copied to a contiguous CPU tensor one at a time
// (any device in; dtypes F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL, F8_E4M3 F8_E5M2). Names must be
// unique and not "__metadata__" (CheckpointError). Atomic: a temporary file in the same directory,
// every write checked, fsync, rename, fsync of the directory; on failure (disk full, ...) the
// temporary file is removed and an IoError names the file. Returns the bytes written.
int64_t write_safetensors(const std::string& path,
                          const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                          const std::map<std::string, std::string>& metadata = {});

}  // namespace parallax::checkpoint
