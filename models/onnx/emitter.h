// The ONNX emit interface of the model zoo. Every layer writes its own forward as ONNX nodes
// (opset 17) through an Emitter; a model's emit_onnx() (models/model.h) walks its layers in forward
// order, and the exporter (checkpoint/export) turns the result into model.onnx.
//
// Why models do not link libonnx: the emitters talk to the small abstract GraphBuilder below, which
// checkpoint/export implements with libonnx's protobuf classes. The model layer thus stays free of
// protobuf (it builds on machines without libonnx, such as the GPU nodes, and its headers stay
// cheap to compile), the exporter owns every file-format decision (initializer storage, external
// data, checker, shape inference), as ARCHITECTURE.md §4 asks of checkpoint/, and an emitter can be
// tested against any GraphBuilder.
//
// Contracts an emitter keeps:
//   - Semantics: the nodes compute what the layer's forward() computes in eval mode on the CPU,
//     fused kernels (kernels/) included, whose ATen reference each emitter mirrors. Only standard
//     opset-17 ops of the default domain: no custom ops, so ONNX Runtime and TensorRT >= 8.5 run
//     the graph unmodified.
//   - Weights: every parameter or buffer the forward reads is emitted once with weight(leaf), as an
//     initializer named by its module path (exactly the names of weights.h5, checkpoint/weights.h);
//     a tensor the forward does not read is declared with not_exported(). The exporter fails when a
//     model tensor is neither (a layer whose weights were silently dropped).
//   - Scopes: an emitter enters scope(child) with the name its module was registered under, so
//     paths match torch::nn::Module::named_parameters().
//   - Precision: the graph computes in dtype() (float32 or float16). Weights are stored in dtype().
//     Graph inputs and outputs keep their float32/uint8 types for both dtypes (one interface for
//     either engine), norms, softmax and the camera geometry run in float32 as under LibTorch's
//     autocast, and the sampling in float32 as kernels/bev_sample does.
//   - Errors: a layer without an emitter throws parallax::Error naming its module path and type
//     (no_emitter()).
//
// Hooks for the trainers built on this exporter (not implemented here): EmitHooks lets a LoRA run
// export merged weights (weight_value) and a QAT run wrap each Linear/Conv input and weight in
// QuantizeLinear/DequantizeLinear (layer_input, layer_weight); emitters call them at those points.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <variant>
#include <vector>

namespace parallax::models::onnx {

// A tensor of the graph under construction, by its unique name.
struct Value {
  std::string name;
};

// In the dims of a graph input or output: the batch axis (symbolic "batch", or the fixed batch).
inline constexpr int64_t kBatch = -1;

// A node attribute; tensor attributes (Constant's `value`) hold a contiguous CPU tensor.
using AttrValue = std::variant<int64_t, double, std::string, std::vector<int64_t>,
                               std::vector<double>, at::Tensor>;
struct Attr {
  std::string name;
  AttrValue value;
};

// The graph being written. Implemented with libonnx by checkpoint/export; names are unique (the
// Emitter makes them so) and nodes arrive in topological order.
class GraphBuilder {
 public:
  virtual ~GraphBuilder() = default;
  // A graph input or output; kBatch in `dims` marks the batch axis (symbolic "batch" when the
  // builder exports a dynamic batch). dtype: float32, float16, uint8, int64 or bool.
  virtual void add_input(const std::string& name, at::ScalarType dtype,
                         const std::vector<int64_t>& dims) = 0;
  virtual void add_output(const std::string& name, at::ScalarType dtype,
                          const std::vector<int64_t>& dims) = 0;
  // A node of the default domain; "" in `inputs` is an omitted optional input.
  virtual void add_node(const std::string& op_type, const std::string& node_name,
                        const std::vector<std::string>& inputs,
                        const std::vector<std::string>& outputs,
                        const std::vector<Attr>& attrs) = 0;
  // An initializer named `name` holding `value` (contiguous CPU tensor of the dtype to store).
  virtual void add_initializer(const std::string& name, const at::Tensor& value) = 0;
  // A model metadata_props entry.
  virtual void add_metadata(const std::string& key, const std::string& value) = 0;
};

class Emitter;

// Extension points for exports of adapted models; the defaults change nothing.
class EmitHooks {
 public:
  virtual ~EmitHooks() = default;
  // The value exported for weight `name` (module path), before the cast to the export dtype. A
  // LoRA run returns W + scale * B @ A for adapted weights, so the graph has no adapter nodes.
  virtual at::Tensor weight_value(const std::string& name, const at::Tensor& value) {
    return value;
  }
  // The input `x` of Linear/Conv layer `layer` (module path), and its weight `w` (in the export
  // dtype). A QAT run inserts QuantizeLinear -> DequantizeLinear with the layer's learned scales.
  virtual Value layer_input(Emitter& e, const std::string& layer, const Value& x) { return x; }
  virtual Value layer_weight(Emitter& e, const std::string& layer, const Value& w) { return w; }
  // Each input `x` of the residual Add of block `block` (module path). A QAT run inserts the
  // block's shared Q/DQ pair (models::ResidualConvBlock::add_quantizer).
  virtual Value add_input(Emitter& e, const std::string& block, const Value& x) { return x; }
  // An input of an attention matmul of attention `attention` (module path): `which` is "q", "k",
  // "v" (the heads' [B, H, T, hd]) or "p" (the softmax output). A QAT run with qat.attention
  // inserts that input's Q/DQ pair (models::AttentionImpl::add_quantizers).
  virtual Value attention_input(Emitter& e, const std::string& attention, const char* which,
                                const Value& x) {
    return x;
  }
};

struct EmitOptions {
  at::ScalarType dtype = at::kFloat;  // the graph's compute dtype: kFloat or kHalf
  int64_t batch = 0;                  // 0: dynamic batch axis; else the fixed batch size
  bool allow_non_finite = false;      // false: a NaN/inf weight is an error naming it
  EmitHooks* hooks = nullptr;         // null: EmitHooks' defaults
};

class Emitter {
 public:
  // `model`: the root module; its parameters and buffers are the weights, by module path.
  Emitter(GraphBuilder& graph, torch::nn::Module& model, EmitOptions options);

  at::ScalarType dtype() const { return opts_.dtype; }
  // 0 for a dynamic batch.
  int64_t batch() const { return opts_.batch; }
  EmitHooks& hooks() { return *hooks_; }

  // ---- module paths ----
  // RAII: the current module path is extended by `child` until the Scope is destroyed.
  class Scope {
   public:
    Scope(Scope&& o) noexcept : e_(o.e_) { o.e_ = nullptr; }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    Scope& operator=(Scope&&) = delete;
    ~Scope();

   private:
    friend class Emitter;
    explicit Scope(Emitter* e) : e_(e) {}
    Emitter* e_;
  };
  [[nodiscard]] Scope scope(const std::string& child);
  // The current module path joined with `leaf` ("encoder.vit.block0" + "norm1.weight").
  std::string path(const std::string& leaf = "") const;

  // ---- weights ----
  // The initializer of model tensor path(leaf), in dtype() when floating. Emitted on first use.
  // Throws Error for a name the model does not have (an emitter bug) and, unless
  // allow_non_finite, for NaN/inf values (naming the tensor and the count).
  Value weight(const std::string& leaf);
  // The model tensor path(leaf) itself (shape queries, host-side constants).
  const at::Tensor& tensor(const std::string& leaf) const;
  // Declares model tensor path(leaf) as not read by the forward (e.g. a loss-only buffer); `why`
  // goes to the model's metadata ("parallax.not_exported": "name: why; ..."), so it has no ';'.
  void not_exported(const std::string& leaf, const std::string& why);
  // Declares model tensor `name` (a full path, not under the current scope) as read by the graph
  // through other nodes than its own initializer (a QAT quantizer's amax becomes the constant scale
  // of its QuantizeLinear). Throws Error for a name the model does not have.
  void mark_read(const std::string& name);
  // Emitted initializer names, in emission order.
  const std::vector<std::string>& weight_names() const { return emitted_; }
  // Declared not_exported() names with their reasons.
  const std::map<std::string, std::string>& not_exported_names() const { return skipped_; }
  // Model tensors neither emitted nor declared, sorted.
  std::vector<std::string> unaccounted() const;

  // ---- graph inputs and outputs ----
  Value input(const std::string& name, at::ScalarType dtype, const std::vector<int64_t>& dims);
  // Names `x` as graph output `name` (an Identity node) with the given dtype and dims.
  void output(const std::string& name, const Value& x, at::ScalarType dtype,
              const std::vector<int64_t>& dims);
  void metadata(const std::string& key, const std::string& value) {
    graph_.add_metadata(key, value);
  }

  // ---- nodes ----
  Value op(const std::string& type, const std::vector<Value>& inputs,
           const std::vector<Attr>& attrs = {});
  std::vector<Value> ops(const std::string& type, const std::vector<Value>& inputs, int outputs,
                         const std::vector<Attr>& attrs = {});
  // A Constant node holding `t` (any dtype, copied).
  Value constant(const at::Tensor& t);
  Value ints(const std::vector<int64_t>& v);                                     // int64 [n]
  Value scalar(double v, at::ScalarType dtype);                                  // 0-d
  Value floats(const std::vector<float>& v, const std::vector<int64_t>& shape);  // float32

  Value reshape(const Value& x,
                const std::vector<int64_t>& dims);  // 0 copies, -1 infers (opset 14)
  Value transpose(const Value& x, const std::vector<int64_t>& perm);
  Value cast(const Value& x, at::ScalarType dtype);
  Value unsqueeze(const Value& x, const std::vector<int64_t>& axes);
  Value squeeze(const Value& x, const std::vector<int64_t>& axes);
  Value slice(const Value& x, int64_t axis, int64_t start, int64_t end);
  Value concat(const std::vector<Value>& xs, int64_t axis);
  Value reduce_sum(const Value& x, const std::vector<int64_t>& axes, bool keepdims);
  Value reduce_mean(const Value& x, const std::vector<int64_t>& axes, bool keepdims);
  Value add(const Value& a, const Value& b) { return op("Add", {a, b}); }
  Value sub(const Value& a, const Value& b) { return op("Sub", {a, b}); }
  Value mul(const Value& a, const Value& b) { return op("Mul", {a, b}); }
  Value div(const Value& a, const Value& b) { return op("Div", {a, b}); }
  Value matmul(const Value& a, const Value& b) { return op("MatMul", {a, b}); }
  Value relu(const Value& x) { return op("Relu", {x}); }

  // Throws Error: layer path(leaf) of type `m` has no ONNX emitter.
  [[noreturn]] void no_emitter(const std::string& leaf, const torch::nn::Module& m) const;

 private:
  std::string fresh(const std::string& type);

  GraphBuilder& graph_;
  EmitOptions opts_;
  EmitHooks default_hooks_;
  EmitHooks* hooks_;
  std::map<std::string, at::Tensor> tensors_;  // the model's parameters and buffers by path
  std::set<std::string> emitted_set_;
  std::vector<std::string> emitted_;
  std::map<std::string, std::string> skipped_;
  std::vector<std::string> scope_;
  int64_t counter_ = 0;
};

}  // namespace parallax::models::onnx
