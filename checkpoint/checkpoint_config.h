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
    v("every", every, "save every N steps (0: only at the end of training)", core::Check::at_least(0));
    v("keep_last", keep_last, "checkpoints kept; older ones are pruned after a commit", core::Check::at_least(1));
    v("async", async, "snapshot to host memory and write in a background thread");
  }
};

struct ExportConfig {
  std::string format = "onnx";
  int opset = 17;
  int parity_frames = 8;
  std::string dtype = "fp32";

  template <class V>
  void visit(V& v) {
    v("format", format, "export format", core::Check::one_of({"onnx", "weights"}));
    v("opset", opset, "ONNX opset", core::Check::between(13, 21));
    v("parity_frames", parity_frames, "frames compared against ONNX Runtime", core::Check::at_least(0));
    v("dtype", dtype, "dtype of exported weights", core::Check::one_of({"fp32", "bf16"}));
  }
};

}  // namespace parallax::checkpoint
