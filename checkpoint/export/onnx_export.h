// ONNX export of a trained model with its deployment parity gate (docs/export.md).
//
//   export_onnx(model, frames, "runs/X/export/model.onnx", options) writes, next to the model file:
//     model.onnx (+ model.onnx.data)  opset 17, written with libonnx from the model's emitters
//                                      (models/onnx/emitter.h); initializers named like weights.h5
//     parity.h5                        the parity frames: the graph inputs and LibTorch's outputs
//     parity.json                      ONNX Runtime against LibTorch per output: max-abs, max-rel,
//                                      cosine (worst frame of each), the gate and the verdict
//
// Procedure: everything is written into a staging folder beside the model file
// (".<name>.staging-*", locked by its export while it runs; the next export into that folder
// removes those whose export is gone, e.g. killed); the graph is built, shape-inferred (strict) and
// checked by ONNX's checker; LibTorch's forward runs on each frame (batch 1, eval mode, float32),
// the frames streamed one at a time into parity.h5 (memory bounded whatever their number; the disk
// must hold parity.h5, checked after the first frame); tools/onnx_parity.py (run with
// PARALLAX_PYTHON or the build's Python, under a deadline) checks the file again with
// onnx.checker(full_check=True) and shape inference and runs it in ONNX Runtime (CPU). Only when
// the gate passes are the files renamed into place, model.onnx last: an existing model.onnx is
// replaced whole or not at all, and an error never leaves a partial one. A model that fails the
// gate is kept in `model.onnx.rejected/` beside it for inspection; parity.json then records the
// failure.
//
// The gate (parity_gate()): for every output and every frame, cosine similarity with LibTorch
// >= min_cosine and max |onnx - torch| <= max_abs_rel * max(1, max |torch|). docs/export.md derives
// the numbers.
//
// Namespace `exporter`: `export` is a C++ keyword.
#pragma once

#include "core/tensor_dict.h"
#include "models/model.h"
#include "models/onnx/emitter.h"

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace parallax::checkpoint::exporter {

struct ParityGate {
  double min_cosine = 0.9999;
  double max_abs_rel = 1e-3;  // max-abs bound, relative to max(1, max |reference|) of the frame
};

// The gate for a graph computing in `dtype` (float32 or float16).
ParityGate parity_gate(at::ScalarType dtype);
// The gate for a fake-quantized model against its QuantizeLinear/DequantizeLinear graph (float32):
// docs/export.md derives it.
ParityGate qat_parity_gate();

// The rounding ties of a quantized model (QAT), for its parity gate (docs/export.md "QAT models").
// The Q/DQ graph and the fake-quantized forward compute the same function, but each side computes
// the values it quantizes with its own float kernels (other summation orders): a value within float
// noise of a rounding boundary may round up on one side and down on the other, and every quantized
// layer after it spreads that one-step difference (a layer turns a share p of differing inputs into
// about sqrt(p) of differing outputs), until the outputs differ by the quantization noise itself
// (bev_tiny ViT: cosine 0.9992 on box_reg from ~25 such roundings per frame). The parity reference
// therefore records, for every activation QuantizeLinear of the graph, the elements whose quotient
// x / scale lies within kQuantTieMargin of a rounding boundary and the level LibTorch took there;
// the parity tool makes ONNX Runtime take the same levels at those elements (and counts where its
// own rounding differed) and applies the unchanged gate to the outputs. A rounding that differs
// anywhere else, a wrong scale, zero point, axis or saturation, or any other wrong op, still shows.
class QuantTies {
 public:
  virtual ~QuantTies() = default;
  // Per activation QuantizeLinear of the emitted graph (called after the emit): its output's name.
  virtual std::vector<std::string> tensors() = 0;
  // One tensor's ties in one frame: flat indices (int32) into the quantized tensor of the frame's
  // batch of 1 (its shape), and LibTorch's levels there (int8).
  struct Frame {
    at::Tensor index, level;
    std::vector<int64_t> shape;
  };
  // Around each frame's LibTorch forward; end_frame() gives every name of tensors().
  virtual void begin_frame() = 0;
  virtual std::map<std::string, Frame> end_frame() = 0;
};

// Where a rounding counts as a tie, in steps of the scale: |frac(x / scale) - 0.5| < this. The
// two sides' quotients differ by at most 4.3e-4 of a step on bev_tiny (the attention output, the
// longest float path between two quantizers), so 0.01 leaves 23x for longer reductions and other
// CPUs; it marks ~2% of the elements.
inline constexpr double kQuantTieMargin = 0.01;

// The ties of one quantizer call: the flat indices (int32) of `quotient` (x / scale, float32)
// within `margin` of a boundary between two levels of [-128, 127], and the levels nearbyint gives
// there (int8).
std::pair<at::Tensor, at::Tensor> rounding_ties(const at::Tensor& quotient, double margin);

struct OnnxExportOptions {
  int opset = 17;
  at::ScalarType dtype = at::kFloat;         // kFloat | kHalf: the graph's compute dtype
  int64_t batch = 0;                         // 0: dynamic batch axis; else fixed
  std::string external_data = "auto";        // auto: when the weights pass 2 GB | always
  bool allow_non_finite = false;             // export NaN/inf weights instead of failing
  models::onnx::EmitHooks* hooks = nullptr;  // LoRA merge / QAT (models/onnx/emitter.h)
  // The parity gate; unset: parity_gate(dtype). A QAT model's Q/DQ graph has its own
  // (qat_parity_gate()).
  std::optional<ParityGate> gate;
  // ONNX Runtime's batch for a dynamic-batch model (a fixed batch uses that batch); frames are fed
  // in batches of this size, so the dynamic axis is exercised with a size other than 1.
  int64_t parity_batch = 2;
  double parity_timeout_s = 1800;  // deadline of the parity tool
  std::string python;              // "" : $PARALLAX_PYTHON, else the build's interpreter
  std::string tool;           // "" : $PARALLAX_SOURCE_DIR/tools/onnx_parity.py (build's source dir)
  std::string frames_source;  // where the frames came from, for parity.json
  std::map<std::string, std::string> metadata;  // extra metadata_props (run, checkpoint, step, ...)
  // A quantized model's rounding ties (QAT; null otherwise): recorded with the parity reference
  // and imposed on ONNX Runtime's run by the parity tool (QuantTies). Not owned.
  QuantTies* quant_ties = nullptr;
  // Called between parity frames and while the parity tool runs (optional). It stops the export by
  // throwing (e.g. train::PreemptedError on SIGTERM): the staging folder is removed, the tool's
  // process stopped, and nothing is published.
  std::function<void()> interruption;
};

// The parity frames, produced one at a time: frame(i) for i = 0 .. count - 1, in order, each
// holding every graph input with a leading batch dimension of 1 (CPU).
struct ParityFrames {
  int64_t count = 0;
  std::function<core::TensorDict(int64_t index)> frame;
};

struct OnnxExportResult {
  std::string model_file, data_file;  // data_file "" without external data
  std::string parity_json;            // "" when no frames were checked
  int64_t model_bytes = 0, data_bytes = 0;
  int64_t initializers = 0;
  double graph_s = 0, reference_s = 0, parity_s = 0;  // build+check+write, LibTorch, tool
  std::string parity_summary;                         // the tool's last line
};

// Weights above this many bytes go to external data: protobuf cannot serialise a message of 2 GiB
// or more, and the graph itself (nodes, constants such as the BEV reference points) needs room.
inline constexpr int64_t kInlineWeightLimit = 2'000'000'000;

// Whether weights of `weight_bytes` (in the export dtype) are written as external data under
// `mode` (auto | always).
bool use_external_data(const std::string& mode, int64_t weight_bytes);

// Throws UsageError naming the value for options this exporter cannot write (opset other than 17,
// dtype, batch, external_data).
void validate(const OnnxExportOptions& options);

// The interpreter and tool export_onnx() would run.
std::string parity_python(const OnnxExportOptions& options);
std::string parity_tool(const OnnxExportOptions& options);

// Throws Error unless parity_python() can import onnxruntime, onnx, numpy and h5py (naming the
// missing module and how to install it): the check to run before anything expensive.
void check_parity_runtime(const OnnxExportOptions& options);

// Creates the folder of `model_file` and checks that files can be created in it; throws IoError
// naming the folder otherwise. First throws UsageError naming the path when `model_file` or a
// file the export writes beside it (model_file.data, parity.h5, parity.json) exists and is not a
// regular file (a device node, FIFO, directory or socket: core/files.h), before creating anything.
void prepare_output_dir(const std::string& model_file);

// Exports `model` (weights loaded; any device, exported from CPU copies) to `model_file` and, when
// `frames` is not empty, gates it against LibTorch on them. Each frame holds every graph input
// with a leading batch dimension of 1 (CPU). Throws Error naming the layer, tensor, output or frame
// (see the file comment); nothing is left at `model_file` unless everything passed.
OnnxExportResult export_onnx(models::Model& model, const ParityFrames& frames,
                             const std::string& model_file, const OnnxExportOptions& options);
// The same with frames held in memory.
OnnxExportResult export_onnx(models::Model& model, const std::vector<core::TensorDict>& frames,
                             const std::string& model_file, const OnnxExportOptions& options);

// Removes the staging folders of exports to `model_file` whose export no longer runs (killed
// before it could clean up): ".<name>.staging-*" beside it whose lock can be taken. Folders of a
// running export are kept. Returns how many were removed; never throws (a folder it cannot
// remove is left for the next export).
int remove_stale_staging(const std::string& model_file);

}  // namespace parallax::checkpoint::exporter
