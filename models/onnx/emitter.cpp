#include "models/onnx/emitter.h"

#include "core/error.h"
#include "core/strings.h"

#include <ATen/ATen.h>

namespace parallax::models::onnx {

Emitter::Scope::~Scope() {
  if (e_) e_->scope_.pop_back();
}

Emitter::Emitter(GraphBuilder& graph, torch::nn::Module& model, EmitOptions options)
    : graph_(graph), opts_(options), hooks_(options.hooks ? options.hooks : &default_hooks_) {
  PARALLAX_CHECK(opts_.dtype == at::kFloat || opts_.dtype == at::kHalf, Error,
                 "ONNX export: the graph dtype must be float32 or float16, got {}",
                 c10::toString(opts_.dtype));
  PARALLAX_CHECK(opts_.batch >= 0, Error, "ONNX export: batch must be >= 0 (0: dynamic), got {}",
                 opts_.batch);
  for (const auto& p : model.named_parameters(true)) {
    if (p.value().defined()) tensors_.emplace(p.key(), p.value());
  }
  for (const auto& b : model.named_buffers(true)) {
    if (b.value().defined()) tensors_.emplace(b.key(), b.value());
  }
}

Emitter::Scope Emitter::scope(const std::string& child) {
  scope_.push_back(child);
  return Scope(this);
}

std::string Emitter::path(const std::string& leaf) const {
  std::vector<std::string> parts(scope_);
  if (!leaf.empty()) parts.push_back(leaf);
  return core::join(parts, ".");
}

const at::Tensor& Emitter::tensor(const std::string& leaf) const {
  const std::string name = path(leaf);
  auto it = tensors_.find(name);
  PARALLAX_CHECK(
      it != tensors_.end(), Error,
      "ONNX export: the emitter asked for tensor '{}', which the model does not have (emitter bug)",
      name);
  return it->second;
}

Value Emitter::weight(const std::string& leaf) {
  const std::string name = path(leaf);
  if (emitted_set_.count(name)) return {name};
  at::Tensor t = hooks_->weight_value(name, tensor(leaf)).detach().to(at::kCPU);
  if (at::isFloatingType(t.scalar_type())) {
    if (!opts_.allow_non_finite) {
      const int64_t bad = t.numel() - at::isfinite(t).sum().item<int64_t>();
      PARALLAX_CHECK(bad == 0, Error,
                     "ONNX export: weight '{}' has {} non-finite value(s) (NaN or inf) of {}; the "
                     "checkpoint holds a "
                     "diverged model",
                     name, bad, t.numel());
    }
    t = t.to(opts_.dtype);
  }
  graph_.add_initializer(name, t.contiguous());
  emitted_set_.insert(name);
  emitted_.push_back(name);
  return {name};
}

void Emitter::not_exported(const std::string& leaf, const std::string& why) {
  (void)tensor(leaf);  // must exist
  PARALLAX_CHECK(why.find(';') == std::string::npos, Error,
                 "ONNX export: the reason for not exporting '{}' has a ';'", path(leaf));
  skipped_.emplace(path(leaf), why);
}

void Emitter::mark_read(const std::string& name) {
  PARALLAX_CHECK(tensors_.count(name) != 0, Error, "ONNX export: the model has no tensor '{}'",
                 name);
  emitted_set_.insert(name);
}

std::vector<std::string> Emitter::unaccounted() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : tensors_) {
    if (!emitted_set_.count(name) && !skipped_.count(name)) out.push_back(name);
  }
  return out;
}

Value Emitter::input(const std::string& name, at::ScalarType dtype,
                     const std::vector<int64_t>& dims) {
  graph_.add_input(name, dtype, dims);
  return {name};
}

void Emitter::output(const std::string& name, const Value& x, at::ScalarType dtype,
                     const std::vector<int64_t>& dims) {
  graph_.add_node("Identity", fresh("Identity"), {x.name}, {name}, {});
  graph_.add_output(name, dtype, dims);
}

std::string Emitter::fresh(const std::string& type) {
  const int64_t id = counter_++;
  return scope_.empty() ? fmt::format("/{}_{}", type, id)
                        : fmt::format("/{}/{}_{}", path(), type, id);
}

std::vector<Value> Emitter::ops(const std::string& type, const std::vector<Value>& inputs,
                                int outputs, const std::vector<Attr>& attrs) {
  const std::string node = fresh(type);
  std::vector<std::string> in, out;
  for (const Value& v : inputs) in.push_back(v.name);
  std::vector<Value> result;
  for (int i = 0; i < outputs; ++i) {
    out.push_back(outputs == 1 ? node : fmt::format("{}:{}", node, i));
    result.push_back({out.back()});
  }
  graph_.add_node(type, node, in, out, attrs);
  return result;
}

Value Emitter::op(const std::string& type, const std::vector<Value>& inputs,
                  const std::vector<Attr>& attrs) {
  return ops(type, inputs, 1, attrs)[0];
}

Value Emitter::constant(const at::Tensor& t) {
  return op("Constant", {}, {{"value", t.detach().to(at::kCPU).contiguous().clone()}});
}

Value Emitter::ints(const std::vector<int64_t>& v) {
  return constant(at::tensor(v, at::kLong));
}

Value Emitter::scalar(double v, at::ScalarType dtype) {
  // at::scalar_tensor rounds v to dtype once, as ATen does for a Scalar operand.
  return constant(at::scalar_tensor(v, at::TensorOptions().dtype(dtype)));
}

Value Emitter::floats(const std::vector<float>& v, const std::vector<int64_t>& shape) {
  return constant(at::tensor(v, at::kFloat).reshape(shape));
}

Value Emitter::reshape(const Value& x, const std::vector<int64_t>& dims) {
  return op("Reshape", {x, ints(dims)});
}

Value Emitter::transpose(const Value& x, const std::vector<int64_t>& perm) {
  return op("Transpose", {x}, {{"perm", perm}});
}

Value Emitter::cast(const Value& x, at::ScalarType dtype) {
  int64_t to = 0;
  switch (dtype) {
    case at::kFloat:
      to = 1;
      break;  // TensorProto::FLOAT
    case at::kByte:
      to = 2;
      break;  // UINT8
    case at::kLong:
      to = 7;
      break;  // INT64
    case at::kBool:
      to = 9;
      break;  // BOOL
    case at::kHalf:
      to = 10;
      break;  // FLOAT16
    default:
      throw_error<Error>("ONNX export: no Cast to {}", c10::toString(dtype));
  }
  return op("Cast", {x}, {{"to", to}});
}

Value Emitter::unsqueeze(const Value& x, const std::vector<int64_t>& axes) {
  return op("Unsqueeze", {x, ints(axes)});
}

Value Emitter::squeeze(const Value& x, const std::vector<int64_t>& axes) {
  return op("Squeeze", {x, ints(axes)});
}

Value Emitter::slice(const Value& x, int64_t axis, int64_t start, int64_t end) {
  return op("Slice", {x, ints({start}), ints({end}), ints({axis})});
}

Value Emitter::concat(const std::vector<Value>& xs, int64_t axis) {
  return op("Concat", xs, {{"axis", axis}});
}

Value Emitter::reduce_sum(const Value& x, const std::vector<int64_t>& axes, bool keepdims) {
  // Opset 13+: ReduceSum takes its axes as an input.
  return op("ReduceSum", {x, ints(axes)}, {{"keepdims", int64_t{keepdims ? 1 : 0}}});
}

Value Emitter::reduce_mean(const Value& x, const std::vector<int64_t>& axes, bool keepdims) {
  // Opset 17: ReduceMean's axes are still an attribute (an input from opset 18).
  return op("ReduceMean", {x}, {{"axes", axes}, {"keepdims", int64_t{keepdims ? 1 : 0}}});
}

void Emitter::no_emitter(const std::string& leaf, const torch::nn::Module& m) const {
  throw_error<Error>("ONNX export: layer '{}' ({}) has no ONNX emitter", path(leaf), m.name());
}

}  // namespace parallax::models::onnx
