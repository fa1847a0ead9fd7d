// The Q/DQ ONNX export of a quantized model (qat.h, export_hooks() and activation_qdq()): the
// emitter hooks that put QuantizeLinear -> DequantizeLinear on every quantized layer's input and
// weight and on both inputs of a quantized residual Add, and the record of the activation
// QuantizeLinear nodes they wrote (`parallax export` ties the scales of a residual Add's inputs
// through it).
#include "train/qat/qat.h"

#include "core/error.h"
#include "models/onnx/emitter.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>

namespace parallax::train::qat {

namespace {

class QdqHooks : public models::onnx::EmitHooks {
 public:
  explicit QdqHooks(const std::vector<Layer>& layers) {
    for (const auto& l : layers) by_path_[l.path] = l;
  }
  models::onnx::Value layer_input(models::onnx::Emitter& e, const std::string& layer,
                                  const models::onnx::Value& x) override {
    return wrap(e, layer, "input", x);
  }
  const std::vector<ActivationQdq>& activations() const { return activations_; }
  models::onnx::Value layer_weight(models::onnx::Emitter& e, const std::string& layer,
                                   const models::onnx::Value& w) override {
    return wrap(e, layer, "weight", w);
  }
  models::onnx::Value add_input(models::onnx::Emitter& e, const std::string& block,
                                const models::onnx::Value& x) override {
    return wrap(e, block, "add", x);
  }
  models::onnx::Value attention_input(models::onnx::Emitter& e, const std::string& attention,
                                      const char* which, const models::onnx::Value& x) override {
    return wrap(e, attention + "." + which, "attention", x);
  }

 private:
  // `x` through the layer's `what` ("input" / "weight") quantizer, if it has one; its amax buffer
  // is read through the pair's scale.
  models::onnx::Value wrap(models::onnx::Emitter& e, const std::string& layer, const char* what,
                           const models::onnx::Value& x) const {
    const auto it = by_path_.find(layer);
    if (it == by_path_.end()) return x;
    const std::string kind = what;
    if ((kind == "add") != it->second.is_add()) return x;
    const bool attention = it->second.kind == Layer::Kind::kAttention;
    if ((kind == "attention") != attention) return x;
    const auto& q = kind == "weight" ? it->second.weight : it->second.input;
    if (!q) return x;
    // An attention input's quantizer is "<attention>.<q|k|v|p>_quantizer".
    e.mark_read(layer + (attention ? "" : "." + kind) + "_quantizer.amax");
    std::string q_output;
    const models::onnx::Value y = qdq(e, layer, what, x, *q, &q_output);
    if (kind != "weight") {
      auto a = std::find_if(activations_.begin(), activations_.end(),
                            [&](const ActivationQdq& r) { return r.quantizer == q; });
      if (a == activations_.end()) a = activations_.insert(activations_.end(), {layer, q, {}});
      a->outputs.push_back(q_output);
    }
    return y;
  }

  static models::onnx::Value qdq(models::onnx::Emitter& e, const std::string& layer,
                                 const char* what, const models::onnx::Value& x,
                                 const models::TensorQuantizerImpl& q, std::string* q_output) {
    PARALLAX_CHECK(q.state() == models::QuantState::kQuantizing, Error,
                   "QAT export: the {} quantizer of layer '{}' is not calibrated (frozen)", what,
                   layer);
    PARALLAX_CHECK(e.dtype() == at::kFloat, ConfigError,
                   "key 'export.dtype': a QAT model exports in fp32 (QuantizeLinear of float16 "
                   "needs opset 19; this exporter writes opset 17)");
    const at::Tensor scale = q.scale().detach().to(at::kCPU, at::kFloat).contiguous();
    const bool per_channel = q.per_channel();
    const models::onnx::Value s = per_channel ? e.constant(scale) : e.constant(scale.reshape({}));
    const models::onnx::Value zp = per_channel ? e.constant(at::zeros({scale.numel()}, at::kChar))
                                               : e.constant(at::zeros({}, at::kChar));
    std::vector<models::onnx::Attr> attrs;
    if (per_channel) attrs.push_back({"axis", int64_t{0}});
    const models::onnx::Value qx = e.op("QuantizeLinear", {x, s, zp}, attrs);
    *q_output = qx.name;
    return e.op("DequantizeLinear", {qx, s, zp}, attrs);
  }

  std::map<std::string, Layer> by_path_;
  // `wrap` is const (called from the emitters through the hooks); what it wrote is recorded here.
  mutable std::vector<ActivationQdq> activations_;
};

}  // namespace

std::unique_ptr<models::onnx::EmitHooks> export_hooks(const std::vector<Layer>& layers) {
  return std::make_unique<QdqHooks>(layers);
}

std::vector<ActivationQdq> activation_qdq(const models::onnx::EmitHooks& hooks) {
  const auto* h = dynamic_cast<const QdqHooks*>(&hooks);
  PARALLAX_CHECK(h != nullptr, Error, "QAT export: hooks not made by qat::export_hooks()");
  return h->activations();
}

}  // namespace parallax::train::qat
