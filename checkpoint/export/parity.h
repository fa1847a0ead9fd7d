// Internal: the parity gate of an ONNX export (docs/export.md). LibTorch's outputs of every frame
// are streamed with the frame's inputs into parity.h5 (one frame in memory at a time, with a
// quantized model's rounding ties), then tools/onnx_parity.py runs the staged model in ONNX
// Runtime on the same inputs and writes its verdict to parity.json. The gate's public parts
// (parity_gate, qat_parity_gate, rounding_ties, check_parity_runtime, parity_python, parity_tool)
// are declared in onnx_export.h and defined in parity.cpp.
//
// Errors: Error naming the frame, the output or the tool; IoError for parity.h5 and a disk too
// small for it. Thread-safety: none (the export's).
#pragma once

#include "checkpoint/export/onnx_export.h"
#include "checkpoint/export/staging.h"

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace parallax::checkpoint::exporter {

// "fp16" or "fp32": the export dtype as the graph's metadata and parity.json name it.
const char* export_dtype_label(at::ScalarType dtype);

// parity.h5's "config" attribute (and the tool's view of the run): the model file `name`, the
// graph's inputs and outputs, the gate, the frames and, for a quantized model, the tied tensors.
std::string parity_config(const OnnxExportOptions& o, const std::string& name, int64_t frames,
                          const std::vector<std::string>& inputs,
                          const std::vector<std::string>& outputs);

// Runs `model` (eval mode, no grad; its training mode restored after) on every frame and writes
// inputs, outputs and ties to `h5`. Refuses (IoError naming `dir`) a frame count the disk cannot
// hold, after the first frame. Returns the seconds spent in forward().
double write_parity_reference(models::Model& model, const ParityFrames& frames,
                              const OnnxExportOptions& o, const std::vector<std::string>& inputs,
                              const std::vector<std::string>& outputs, const std::string& config,
                              const std::filesystem::path& h5, const std::filesystem::path& dir,
                              const std::function<void()>& interruption_point);

// Runs the parity tool on the staged model `name` and parity.h5, filling the result's parity_s and
// parity_summary. A failed gate moves the candidate to `dir`/<name>.rejected (parity.json and
// parity.h5 copied to `dir`), releases `staging` and throws Error with the tool's numbers.
void run_parity_tool(const OnnxExportOptions& o, StagingDir& staging,
                     const std::filesystem::path& dir, const std::string& name, int64_t frames,
                     OnnxExportResult& result, const std::function<void()>& interruption_point);

}  // namespace parallax::checkpoint::exporter
