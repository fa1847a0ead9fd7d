// Weights only: loading model tensors by name into a module (from a checkpoint or an exported
// weights.h5), and exporting a checkpoint's model tensors to one consolidated weights.h5.
//
// weights.h5 (format "parallax-weights", version 2), readable by h5py:
//   - one dataset per model tensor (parameters and buffers) at the file's root, named by its flat
//     module path ("backbone.blocks.0.attn.qkv.weight"), holding the whole (unsharded) tensor;
//   - floating tensors in the export dtype: float32 as IEEE float32; bfloat16 as uint16 holding the
//     raw bf16 bits (h5py: `np.asarray(d).astype(np.uint32) << 16` viewed as float32 is exact);
//     integer and bool tensors (e.g. BatchNorm's num_batches_tracked) keep their dtype;
//   - dataset attributes "dtype" ("float32", "bfloat16", "int64", ...) and "crc32" (from format
//     version 2: the zlib crc32 of the dataset's bytes as stored, C order, as checkpoint shards
//     record it; every load verifies it; a version 1 file, without them, loads with a warning);
//   - file attributes "format", "format_version", "step", "config_hash", "source" (the checkpoint).
// Export streams tensor by tensor (one whole tensor in host memory at a time), writes to a
// temporary file and renames it into place.
//
// Module names are torch::nn::Module::named_parameters() / named_buffers() paths; in checkpoints
// they are stored under the prefix "model/".
#pragma once

#include "checkpoint/pretrained.h"
#include "checkpoint/reader.h"

#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace parallax::checkpoint {

inline constexpr const char* kModelPrefix = "model/";
inline constexpr const char* kWeightsFormat = "parallax-weights";
inline constexpr int kWeightsFormatVersion = 2;
inline constexpr const char* kWeightsChecksumAttr = "crc32";

struct ShapeMismatch {
  std::string name;
  std::vector<int64_t> saved;  // shape in the checkpoint / weights file
  std::vector<int64_t> model;  // shape in the module
};

struct WeightsReport {
  std::vector<std::string> loaded;
  std::vector<std::string> missing;     // in the module, not in the source
  std::vector<std::string> unexpected;  // in the source, not in the module
  std::vector<ShapeMismatch> mismatched;
  // A foreign file (checkpoint/pretrained.h): what its convention dropped on purpose (a classifier
  // head), the tensors whose values were adapted (a resampled position embedding), and what was
  // done to the names (prefix, wrapper, rules).
  std::string format;  // "checkpoint", "weights.h5", "safetensors", "torch.save"
  std::vector<std::string> ignored, adapted, notes;
  bool clean() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  // "loaded 12; missing: a, b; unexpected: c; shape mismatch: d [4, 8] in the checkpoint vs [4, 9]"
  std::string summary() const;
  // The load report as a table: one line of counts per kind, then the names of each kind
  // (`max_names` at most per kind, then "... and N more"), for the log.
  std::string table(std::size_t max_names = 20) const;
  // The report as one JSON object (counts and every name), for metrics.jsonl's "load" row.
  std::string json() const;
};

// The pieces of one saved tensor a module tensor holds (WeightsOptions::boxes_of).
struct TensorBoxes {
  std::vector<int64_t> shape;  // the saved (global) tensor's shape
  // Views of the module tensor, each with its offsets in the saved tensor.
  std::vector<std::pair<at::Tensor, std::vector<int64_t>>> boxes;
};

struct WeightsOptions {
  // Strict: any missing, unexpected or mismatched tensor is a CheckpointError listing them all, and
  // nothing is loaded. Non-strict: the tensors that match are loaded, the rest is reported.
  bool strict = true;
  // Checksums: a checkpoint's shards, a weights file's tensors (their "crc32" attributes); a
  // mismatch is a ChecksumError (checkpoint/checksum_error.h) naming the file and the tensor.
  bool verify = true;
  // Prefix of model tensors inside a checkpoint.
  std::string prefix = kModelPrefix;
  // For modules whose tensors are pieces of the saved (global) tensors (tensor parallelism): the
  // boxes of saved tensor `name` that the module's `local` holds (tensor::split_boxes). nullopt:
  // `local` is the whole tensor. Each rank then reads only its boxes, from a checkpoint or a
  // weights file (HDF5 hyperslabs), never the whole tensor.
  std::function<std::optional<TensorBoxes>(const std::string& name, const at::Tensor& local)>
      boxes_of;
  // How a foreign file (safetensors, torch.save: checkpoint/tensor_source.h) maps into the module
  // (checkpoint/pretrained.h); unset: Parallax's own names. With a non-empty root, only the
  // module's tensors under it are loaded or reported missing, and a Parallax source's tensors
  // outside it are ignored.
  std::optional<PretrainedOptions> pretrained;
};

// A training-only tensor of a model (models/model.h, kAuxModule: "aux.<module>...", or an FP8
// layer's scaling history, is_fp8_state): never exported, and not "unexpected" when a model
// without it loads a checkpoint that has it.
bool is_aux_tensor(const std::string& name);
// The delayed FP8 recipe's amax history ("<layer>.fp8.amax_history", kernels/fp8.h): not "missing"
// either when a checkpoint without it is loaded (the history starts empty).
bool is_fp8_state(const std::string& name);

// Loads `module`'s parameters and buffers from `path`: an exported weights .h5 file, a checkpoint
// (a checkpoint directory, a checkpoints directory or a run directory), or a foreign file
// (safetensors, a sharded safetensors set, torch.save; WeightsOptions::pretrained). A foreign
// file's tensors are all read and checked (NaN/inf, a dtype the module tensor cannot take) before
// the first is copied into the module: a refused file loads nothing. Values are
// converted to each module tensor's dtype and device. Throws CheckpointError (strict, or a corrupt
// source) naming the file and tensors.
WeightsReport load_weights(torch::nn::Module& module, const std::string& path,
                           const WeightsOptions& options = {});
// Same, from an open checkpoint.
WeightsReport load_weights(CheckpointReader& reader, torch::nn::Module& module,
                           const WeightsOptions& options = {});

// The same check of `module` against `path` as load_weights (strict: CheckpointError naming the
// tensors, nothing read), but nothing is loaded: `readers` holds, per tensor of report.loaded, a
// function that reads it (this rank's boxes under boxes_of) into a new CPU tensor of the module
// tensor's shape and dtype, one tensor in memory at a time. `module` may be shape-only or built
// under deferred construction (units/param_init.h): a rank materialises only what it owns from
// pretrained weights or a checkpoint. The source stays open while a reader lives; readers may run
// in any order, from one thread at a time.
struct DeferredWeights {
  WeightsReport report;
  std::map<std::string, std::function<at::Tensor()>> readers;
};
DeferredWeights defer_weights(torch::nn::Module& module, const std::string& path,
                              const WeightsOptions& options = {});

// Writes the model tensors (prefix "model/") of the checkpoint at `checkpoint_path` to `out_file`
// (see the file comment); `dtype` is at::kFloat or at::kBFloat16 for floating tensors. Verifies
// checksums while reading. A tensor holding NaN or infinity is a CheckpointError naming it (and
// `out_file` is not written) unless `allow_nonfinite`, which exports it with a warning. Returns
// the number of tensors written. Throws CheckpointError / IoError.
int64_t export_weights(const std::string& checkpoint_path, const std::string& out_file,
                       at::ScalarType dtype, bool allow_nonfinite = false);
// The same file with `tensors` (module paths, whole) as its datasets instead of the checkpoint's
// model tensors, the checkpoint supplying the attributes (a LoRA run's merged model,
// train/lora/lora.h).
int64_t export_weights(const std::string& checkpoint_path, const std::string& out_file,
                       at::ScalarType dtype, bool allow_nonfinite,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors);

// True if `path` is an HDF5 file with the weights format attribute.
bool is_weights_file(const std::string& path);

}  // namespace parallax::checkpoint
