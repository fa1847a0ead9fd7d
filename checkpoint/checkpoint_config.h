// The `checkpoint` and `export` config sections.
#pragma once

#include "core/config.h"

#include <string>

namespace parallax::checkpoint {

struct CheckpointConfig {
  int64_t every = 0;  // steps; 0: only at the end
  int keep_last = 3;
  bool async = false;

  template <class V>
  void visit(V& v) {
    v("every", every, "save every N steps (0: only at the end of training)",
      core::Check::at_least(0));
    v("keep_last", keep_last, "checkpoints kept; older ones are pruned after a commit",
      core::Check::at_least(1));
    v("async", async, "snapshot to host memory and write in a background thread");
  }
};

// `parallax export`'s defaults (docs/export.md); its command-line options override each key.
struct ExportConfig {
  std::string format = "onnx";
  int opset = 17;
  int parity_frames = 8;
  std::string dtype = "fp32";
  int64_t batch = 0;  // 0: dynamic batch axis
  std::string external_data = "auto";
  double parity_timeout_s = 1800;

  template <class V>
  void visit(V& v) {
    v("format", format,
      "export format: onnx (model.onnx + parity gate) | weights (weights.h5) | safetensors "
      "(a .safetensors file)",
      core::Check::one_of({"onnx", "weights", "safetensors"}));
    v("opset", opset, "ONNX opset (17: the one the exporter writes)", core::Check::at_least(1));
    v("parity_frames", parity_frames, "frames compared against ONNX Runtime (0: no parity gate)",
      core::Check::at_least(0));
    v("dtype", dtype, "onnx: fp32 | fp16 (the graph's compute dtype); weights: fp32 | bf16",
      core::Check::one_of({"fp32", "fp16", "bf16"}));
    v("batch", batch, "onnx: fixed batch size of the graph (0: a dynamic batch axis)",
      core::Check::at_least(0));
    v("external_data", external_data,
      "onnx: weights in model.onnx.data: auto (above 2 GB) | always",
      core::Check::one_of({"auto", "always"}));
    v("parity_timeout_s", parity_timeout_s,
      "onnx: deadline of the ONNX Runtime parity run, seconds", core::Check::positive());
  }
};

}  // namespace parallax::checkpoint
