// How the model zoo creates its parameters and buffers, and shape-only construction. In core
// because the tensor-parallel layers (parallel/tensor) create the zoo's parameters too, and
// parallel/ may not include models/ (ARCHITECTURE §1).
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
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/nn/module.h>

#include <cstdint>

namespace parallax::core {

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

// N(0, std^2) (as at::randn(shape) * std, the draws every layer has always made), zeros: float32
// on the CPU, or meta tensors of that shape under shape-only construction.
at::Tensor init_normal(c10::IntArrayRef shape, double std);
at::Tensor init_zeros(c10::IntArrayRef shape);

// Replaces every parameter of `m` and its submodules that is not a meta tensor by a meta tensor of
// its shape, dtype and requires_grad, in the module's dictionary and in the public fields of the
// LibTorch layers the zoo uses (Conv2d, LayerNorm, GroupNorm, Linear), so their storage is freed.
// Buffers are not reached (LibTorch keeps them private): the zoo creates its own as meta tensors,
// and its LibTorch layers have none.
void to_meta(torch::nn::Module& m);

// Whether every parameter and buffer of `m` is a meta tensor (a shape-only model).
bool is_shape_only(const torch::nn::Module& m);

}  // namespace parallax::core
