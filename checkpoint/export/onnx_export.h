// ONNX export of a trained model with its deployment parity gate (docs/export.md).
//
//   export_onnx(model, frames, "runs/X/export/model.onnx", options) writes, next to the model file:
//     model.onnx (+ model.onnx.data)  opset 17, written with libonnx from the model's emitters
//                                      (models/onnx/emitter.h); initializers named like weights.h5
//     parity.h5                        the parity frames: the graph inputs and LibTorch's outputs
//     parity.json                      ONNX Runtime against LibTorch per output: max-abs, max-rel,
//                                      cosine (worst frame of each), the gate and the verdict
//
// Procedure: everything is written into a staging folder beside the model file; the graph is
// built, shape-inferred (strict) and checked by ONNX's checker; LibTorch's forward runs on each
// frame (batch 1, eval mode, float32); tools/onnx_parity.py (run with PARALLAX_PYTHON or the
// build's Python, under a deadline) checks the file again with onnx.checker(full_check=True) and
// shape inference and runs it in ONNX Runtime (CPU). Only when the gate passes are the files
// renamed into place, model.onnx last: an existing model.onnx is replaced whole or not at all, and
// an error never leaves a partial one. A model that fails the gate is kept in
// `model.onnx.rejected/` beside it for inspection; parity.json then records the failure.
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
#include <map>
#include <optional>
#include <string>
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
// naming the folder otherwise.
void prepare_output_dir(const std::string& model_file);

// Exports `model` (weights loaded; any device, exported from CPU copies) to `model_file` and, when
// `frames` is not empty, gates it against LibTorch on them. Each frame holds every graph input
// with a leading batch dimension of 1 (CPU). Throws Error naming the layer, tensor, output or frame
// (see the file comment); nothing is left at `model_file` unless everything passed.
OnnxExportResult export_onnx(models::Model& model, const std::vector<core::TensorDict>& frames,
                             const std::string& model_file, const OnnxExportOptions& options);

}  // namespace parallax::checkpoint::exporter
