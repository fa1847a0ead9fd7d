// ONNX emitter of the `mlp` stand-in (models/mlp.h).
#include "models/mlp.h"
#include "models/onnx/ops.h"

namespace parallax::models {

void MlpModel::emit_onnx(onnx::Emitter& e) {
  const onnx::Value x = e.input("x", at::kFloat, {onnx::kBatch, in_});
  onnx::Value y = onnx::module(e, "net", *net_, e.dtype() == at::kFloat ? x : e.cast(x, e.dtype()));
  if (e.dtype() != at::kFloat) y = e.cast(y, at::kFloat);
  e.not_exported("teacher",
                 "the fixed map that defines the loss's regression target, not read by forward()");
  e.output("y_hat", y, at::kFloat, {onnx::kBatch, out_});
}

}  // namespace parallax::models
