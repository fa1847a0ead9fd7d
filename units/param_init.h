// How the model zoo creates its parameters and buffers, and shape-only construction. In units/,
// below models/, kernels/ and parallel/, because the tensor-parallel layers (parallel/tensor) and
// the FP8 layer's history (kernels/fp8.h) create the zoo's tensors too, and neither may include
// models/ (ARCHITECTURE §1).
//
// By default a layer creates its tensors on the CPU with their initial values, drawn from the
// global CPU generator in construction order, so a model built twice from one seed is bitwise the
// same (the equivalence tests of every engine rely on it).
//
// Shape-only construction (ShapeOnlyScope; `parallax plan` builds every model this way): the
// zoo's own layers create each parameter and buffer as a meta tensor (shape, dtype and
// requires_grad; no storage, no values, no draw from the generator). The LibTorch layers the zoo
// uses (Conv2d, LayerNorm, GroupNorm, Linear) allocate and initialise in their constructors;
// build_model() hands a shape-only model to to_meta() at once, so what the caller gets holds no
// parameter or buffer storage. Names, shapes, units, costs and tensor-parallel layouts are those of
// a full build. A shape-only model cannot run forward or hold a checkpoint.
//
// Deferred construction (DeferredInitScope; the trainer builds a ZeRO-3 or pipeline model this way,
// parallel.meta_init, so that a rank materialises only its shard or its stages:
// parallel/parallelize.h): the model is shape-only as above, but
// every tensor keeps a recipe that gives its initial value bitwise as a full build would, at any
// time and in any order. A recipe is the CPU generator's state where the full build drew the
// tensor plus the draw itself, replayed from that state; construction still makes every draw
// (and drops it at once), so the generator leaves the build where a full build leaves it. Peak host
// memory while building: the largest single tensor. The zoo creates its tensors through
// init_tensor() (init_normal, init_zeros) and the LibTorch layers that draw in their constructors
// (Conv2d, Linear) through layer<>(); whatever else a LibTorch layer allocated (LayerNorm's and
// GroupNorm's ones and zeros) is kept as its value by finish_deferred(), which build_model() calls.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace parallax::units {

// Shape-only construction on this thread while it lives (nests).
class ShapeOnlyScope {
 public:
  ShapeOnlyScope();
  ~ShapeOnlyScope();
  ShapeOnlyScope(const ShapeOnlyScope&) = delete;
  ShapeOnlyScope& operator=(const ShapeOnlyScope&) = delete;

 private:
  bool previous_;
};

// Whether a ShapeOnlyScope is active on this thread.
bool shape_only();

// Replaces every parameter of `m` and its submodules that is not a meta tensor by a meta tensor of
// its shape, dtype and requires_grad, in the module's dictionary and in the public fields of the
// LibTorch layers the zoo uses (Conv2d, LayerNorm, GroupNorm, Linear), so their storage is freed.
// Buffers are not reached (LibTorch keeps them private): the zoo creates its own as meta tensors,
// and its LibTorch layers have none.
void to_meta(torch::nn::Module& m);

// Whether every parameter and buffer of `m` is a meta tensor (a shape-only model).
bool is_shape_only(const torch::nn::Module& m);

// The recipes of a model built under a DeferredInitScope, by parameter or buffer name.
class DeferredInit {
 public:
  // The initial value of parameter or buffer `name` (float32 on the CPU), bitwise the full build's.
  // parallax::Error naming it when the model has no such tensor.
  at::Tensor value(const std::string& name) const;
  bool has(const std::string& name) const { return by_name_.count(name) != 0; }
  std::size_t size() const { return by_name_.size(); }

  // Construction (init_tensor, layer<>, finish_deferred): `tensor` (a placeholder) gets the
  // recipe `make`, replayed from generator state `state` (undefined: `make` draws nothing).
  void record(const at::Tensor& tensor, at::Tensor state, std::function<at::Tensor()> make);
  bool recorded(const at::Tensor& tensor) const;
  // The recorded `tensor`'s recipe followed by `fn` on its value (init_modify).
  void then(const at::Tensor& tensor, std::function<void(at::Tensor&)> fn);
  // Tensor `name`'s value from now on is `read()` (pretrained weights or a checkpoint read one
  // tensor at a time, checkpoint::defer_weights) instead of its initialisation; parallax::Error
  // when the model has no such tensor.
  void replace(const std::string& name, std::function<at::Tensor()> read);
  // Names the recorded tensors by `m`'s parameter and buffer names; parallax::Error naming the
  // first tensor of `m` without a recipe. Names bound by an earlier bind() keep their recipes
  // (a transform's tensors are bound after the model's).
  void bind(const torch::nn::Module& m);

 private:
  struct Recipe {
    at::Tensor state;  // the CPU generator's state before the draw
    std::function<at::Tensor()> make;
  };
  std::unordered_map<c10::TensorImpl*, std::pair<at::Tensor, std::shared_ptr<Recipe>>> by_impl_;
  std::map<std::string, std::shared_ptr<Recipe>> by_name_;
};

// Deferred construction on this thread while it lives (not nested in another construction scope).
class DeferredInitScope {
 public:
  DeferredInitScope();
  // Records into `recipes` (a model built under an earlier scope), e.g. while a model transform
  // adds tensors to it; DeferredInit::bind names them afterwards.
  explicit DeferredInitScope(std::shared_ptr<DeferredInit> recipes);
  ~DeferredInitScope();
  DeferredInitScope(const DeferredInitScope&) = delete;
  DeferredInitScope& operator=(const DeferredInitScope&) = delete;
  // The recipes recorded so far (complete once the model is built).
  std::shared_ptr<DeferredInit> recipes() const { return recipes_; }

 private:
  std::shared_ptr<DeferredInit> recipes_;
};

// The recorder of the DeferredInitScope active on this thread, or nullptr.
DeferredInit* deferred_init();

// A placeholder: a tensor of `shape` and `options` whose storage is one element (zero strides;
// NaN for floating types, so a read before the engine sets its data shows), a tensor of its own
// that Tensor::set_data can later point anywhere (a meta tensor cannot take real data in place).
at::Tensor placeholder(c10::IntArrayRef shape, const at::TensorOptions& options);

// A parameter or buffer of shape `shape` whose value `make()` gives, drawing from the global CPU
// generator: make() itself by default, a meta tensor under shape-only construction (nothing
// drawn), a placeholder with a recipe under deferred construction (make() run and dropped).
at::Tensor init_tensor(c10::IntArrayRef shape, std::function<at::Tensor()> make);
// N(0, std^2) (as at::randn(shape) * std, the draws every layer has always made), zeros: float32
// on the CPU; meta tensors of that shape under shape-only construction, placeholders under
// deferred construction.
at::Tensor init_normal(c10::IntArrayRef shape, double std);
at::Tensor init_zeros(c10::IntArrayRef shape);

// Changes a tensor the model created (a prior written into a bias, say) the same way under every
// construction: `fn(t)` at once (no autograd), nothing under shape-only construction, appended to
// the tensor's recipe under deferred construction. `fn` must draw nothing.
void init_modify(at::Tensor t, std::function<void(at::Tensor&)> fn);

// The CPU generator's current state (for recipes).
at::Tensor cpu_generator_state();

// Hands the C allocator's free pages back to the system (glibc's malloc_trim; a no-op elsewhere).
// Deferred construction draws a tensor and drops it while keeping small allocations (the
// recipes): without this, each dropped tensor's pages stay resident in the holes the small ones
// leave in the heap, and the resident size grows with the model after all. Cheap next to a draw.
void release_free_memory();

// A LibTorch layer (Holder: torch::nn::Linear, a Conv2d subclass holder, ...) built from
// `options`; under deferred construction its parameters become placeholders at once (in place:
// the layer's fields and whoever else holds them see it), each with a recipe that rebuilds the
// layer from the generator state it was built from.
template <class Holder, class Options>
Holder layer(const Options& options) {
  DeferredInit* d = deferred_init();
  if (d == nullptr) return Holder(options);
  at::Tensor state = cpu_generator_state();
  Holder h(options);
  std::vector<at::Tensor> params = h->parameters();
  for (std::size_t k = 0; k < params.size(); ++k) {
    d->record(params[k], state, [options, k]() { return Holder(options)->parameters().at(k); });
    params[k].set_data(placeholder(params[k].sizes(), params[k].options()));
  }
  release_free_memory();
  return h;
}

// Under deferred construction: records the value of every parameter and buffer of `m` without a
// recipe yet (a LibTorch layer's ones and zeros), makes them placeholders and names every recipe
// (DeferredInit::bind). No-op otherwise.
void finish_deferred(torch::nn::Module& m);

// Sets, in place, every buffer of `m` (built under deferred construction) to its value from
// `recipes` on `device`, and every parameter to a placeholder on `device`: an engine that
// materialises what it owns sets each parameter's data before anything reads it (ZeRO-3).
void place_deferred(torch::nn::Module& m, const DeferredInit& recipes, const c10::Device& device);

}  // namespace parallax::units
