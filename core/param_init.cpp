#include "core/param_init.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <unordered_map>

namespace parallax::core {

namespace {

thread_local bool t_shape_only = false;

// torch::nn::Module keeps its parameters in a protected dictionary. A class derived from it may
// name it, and the member pointer it forms applies to any Module: the one way to replace a
// registered parameter in place (register_parameter refuses an existing name, and set_data
// refuses a tensor of another device type).
struct ModuleDicts : torch::nn::Module {
  static auto parameters_of() { return &ModuleDicts::parameters_; }
};

at::Tensor meta_like(const at::Tensor& t) {
  at::Tensor m = at::empty(t.sizes(), t.options().device(at::kMeta));
  if (t.requires_grad()) m.set_requires_grad(true);
  return m;
}

// The public fields of the LibTorch layers alias their registered tensors.
template <class Impl>
bool swap_fields(torch::nn::Module& m,
                 const std::unordered_map<c10::TensorImpl*, at::Tensor>& replaced) {
  auto* impl = dynamic_cast<Impl*>(&m);
  if (impl == nullptr) return false;
  for (at::Tensor* f : {&impl->weight, &impl->bias}) {
    if (!f->defined()) continue;
    const auto it = replaced.find(f->unsafeGetTensorImpl());
    if (it != replaced.end()) *f = it->second;
  }
  return true;
}

}  // namespace

ShapeOnlyScope::ShapeOnlyScope() : previous_(t_shape_only) {
  t_shape_only = true;
}
ShapeOnlyScope::~ShapeOnlyScope() {
  t_shape_only = previous_;
}

bool shape_only() {
  return t_shape_only;
}

at::Tensor init_normal(c10::IntArrayRef shape, double std) {
  if (t_shape_only) return at::empty(shape, at::TensorOptions().device(at::kMeta));
  return at::randn(shape) * std;
}

at::Tensor init_zeros(c10::IntArrayRef shape) {
  if (t_shape_only) return at::empty(shape, at::TensorOptions().device(at::kMeta));
  return at::zeros(shape);
}

void to_meta(torch::nn::Module& root) {
  const auto one = [](torch::nn::Module& m) {
    std::unordered_map<c10::TensorImpl*, at::Tensor> replaced;
    for (auto& item : m.*ModuleDicts::parameters_of()) {
      at::Tensor& t = item.value();
      if (!t.defined() || t.is_meta()) continue;
      at::Tensor meta = meta_like(t);
      replaced.emplace(t.unsafeGetTensorImpl(), meta);
      t = std::move(meta);
    }
    if (replaced.empty()) return;
    (void)(swap_fields<torch::nn::Conv2dImpl>(m, replaced) ||
           swap_fields<torch::nn::LayerNormImpl>(m, replaced) ||
           swap_fields<torch::nn::GroupNormImpl>(m, replaced) ||
           swap_fields<torch::nn::LinearImpl>(m, replaced));
  };
  one(root);
  for (const auto& child : root.modules(/*include_self=*/false)) one(*child);
}

bool is_shape_only(const torch::nn::Module& m) {
  for (const auto& p : m.parameters()) {
    if (!p.is_meta()) return false;
  }
  for (const auto& b : m.buffers()) {
    if (!b.is_meta()) return false;
  }
  return true;
}

}  // namespace parallax::core
