// ONNX emitters of models/model.h's and models/layers.h's classes: the defaults (no emitter) and
// the conv blocks.
#include "core/error.h"
#include "models/layers.h"
#include "models/model.h"
#include "models/onnx/ops.h"

namespace parallax::models {

void Model::emit_onnx(onnx::Emitter& e) {
  // The walk: graph inputs, every unit in units() order, graph outputs.
  OnnxFlow flow = emit_onnx_inputs(e);
  const int n = static_cast<int>(units().size());
  for (int i = 0; i < n; ++i) flow.values = emit_onnx_unit(e, i, flow);
  emit_onnx_outputs(e, flow);
}

Model::OnnxFlow Model::emit_onnx_inputs(onnx::Emitter& e) {
  (void)e;
  throw_error<Error>("ONNX export: model '{}' has no ONNX emitter", name());
}

std::vector<onnx::Value> Model::emit_onnx_unit(onnx::Emitter& e, int unit, const OnnxFlow& flow) {
  (void)e;
  (void)flow;
  throw_error<Error>("ONNX export: unit {} ('{}') of model '{}' has no ONNX emitter", unit,
                     units().at(static_cast<std::size_t>(unit)).name, name());
}

void Model::emit_onnx_outputs(onnx::Emitter& e, const OnnxFlow& flow) {
  (void)e;
  (void)flow;
  throw_error<Error>("ONNX export: model '{}' has no ONNX emitter", name());
}

onnx::Value Block::emit_onnx(onnx::Emitter& e, const onnx::Value& x) {
  (void)x;
  e.no_emitter("", *this);
}

onnx::Value ConvNormActImpl::emit_onnx(onnx::Emitter& e, const onnx::Value& x) {
  onnx::Value y = onnx::conv2d(e, x, "conv", *conv_);
  y = onnx::group_norm(e, y, "norm", *norm_, opts_.out_h, opts_.out_w);
  return opts_.act ? e.relu(y) : y;
}

onnx::Value ResidualConvBlock::emit_onnx(onnx::Emitter& e, const onnx::Value& x) {
  onnx::Value y;
  {
    auto s = e.scope("conv1");
    y = conv1_->emit_onnx(e, x);
  }
  {
    auto s = e.scope("conv2");
    y = conv2_->emit_onnx(e, y);
  }
  // The conv branch's pair first, then the skip's: the order in which the forward quantizes them.
  const std::string block = e.path();
  const onnx::Value qy = e.hooks().add_input(e, block, y);
  const onnx::Value qx = e.hooks().add_input(e, block, x);
  return e.relu(e.add(qy, qx));
}

}  // namespace parallax::models
