// ONNX emitter of the `mlp` stand-in (models/mlp.h).
#include "models/mlp.h"
#include "models/onnx/ops.h"

namespace parallax::models {

Model::OnnxFlow MlpModel::emit_onnx_inputs(onnx::Emitter& e) {
  const onnx::Value x = e.input("x", at::kFloat, {onnx::kBatch, in_});
  return {{e.dtype() == at::kFloat ? x : e.cast(x, e.dtype())}, {{"x", x}}};
}

// Unit k: modules 2k (Linear) and 2k + 1 (GELU, absent after the last Linear), as forward().
std::vector<onnx::Value> MlpModel::emit_onnx_unit(onnx::Emitter& e, int unit,
                                                  const OnnxFlow& flow) {
  auto s = e.scope("net");
  const auto children = net_->named_children();
  onnx::Value y = flow.values.at(0);
  for (std::size_t i = 2 * static_cast<std::size_t>(unit);
       i < children.size() && i < 2 * static_cast<std::size_t>(unit) + 2; ++i)
    y = onnx::module(e, children[i].key(), *children[i].value(), y);
  return {y};
}

void MlpModel::emit_onnx_outputs(onnx::Emitter& e, const OnnxFlow& flow) {
  onnx::Value y = flow.values.at(0);
  if (e.dtype() != at::kFloat) y = e.cast(y, at::kFloat);
  e.not_exported("teacher",
                 "the fixed map that defines the loss's regression target, not read by forward()");
  e.output("y_hat", y, at::kFloat, {onnx::kBatch, out_});
}

}  // namespace parallax::models
