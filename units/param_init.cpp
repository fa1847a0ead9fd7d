#include "units/param_init.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <limits>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <unordered_map>

namespace parallax::units {

namespace {

thread_local bool t_shape_only = false;
thread_local DeferredInit* t_deferred = nullptr;

// A tensor of this size or more dropped during deferred construction hands its pages back at once
// (release_free_memory()).
constexpr int64_t kReleaseBytes = 1 << 20;

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

DeferredInitScope::DeferredInitScope() : recipes_(std::make_shared<DeferredInit>()) {
  PARALLAX_CHECK(t_deferred == nullptr && !t_shape_only, Error,
                 "deferred construction inside another shape-only or deferred construction");
  t_deferred = recipes_.get();
}

DeferredInitScope::DeferredInitScope(std::shared_ptr<DeferredInit> recipes)
    : recipes_(std::move(recipes)) {
  PARALLAX_CHECK(recipes_ != nullptr, Error, "deferred construction: no recipes to continue");
  PARALLAX_CHECK(t_deferred == nullptr && !t_shape_only, Error,
                 "deferred construction inside another shape-only or deferred construction");
  t_deferred = recipes_.get();
}

DeferredInitScope::~DeferredInitScope() {
  t_deferred = nullptr;
}

DeferredInit* deferred_init() {
  return t_deferred;
}

at::Tensor cpu_generator_state() {
  auto cpu = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(cpu.mutex());
  return cpu.get_state();
}

void release_free_memory() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

at::Tensor placeholder(c10::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor p =
      at::empty_strided(shape, std::vector<int64_t>(shape.size(), 0), options.requires_grad(false));
  if (p.numel() == 0) return p;
  at::NoGradGuard no_grad;
  at::Tensor element = p.as_strided({1}, {1});  // the one element behind every index
  if (at::isFloatingType(p.scalar_type())) {
    element.fill_(std::numeric_limits<double>::quiet_NaN());
  } else {
    element.zero_();
  }
  return p;
}

void DeferredInit::record(const at::Tensor& tensor, at::Tensor state,
                          std::function<at::Tensor()> make) {
  auto recipe = std::make_shared<Recipe>(Recipe{std::move(state), std::move(make)});
  by_impl_[tensor.unsafeGetTensorImpl()] = {tensor, std::move(recipe)};
}

void DeferredInit::then(const at::Tensor& tensor, std::function<void(at::Tensor&)> fn) {
  const auto it = by_impl_.find(tensor.unsafeGetTensorImpl());
  PARALLAX_CHECK(it != by_impl_.end(), Error,
                 "deferred construction: a tensor changed before it had a recipe");
  std::shared_ptr<Recipe>& r = it->second.second;
  auto next = std::make_shared<Recipe>(*r);
  next->make = [make = r->make, fn = std::move(fn)]() {
    at::Tensor v = make();
    fn(v);
    return v;
  };
  r = std::move(next);
}

void DeferredInit::replace(const std::string& name, std::function<at::Tensor()> read) {
  const auto it = by_name_.find(name);
  PARALLAX_CHECK(it != by_name_.end(), Error, "deferred construction: no recipe for '{}'", name);
  auto next = std::make_shared<Recipe>();
  next->make = std::move(read);  // no state: draws nothing
  it->second = std::move(next);
}

bool DeferredInit::recorded(const at::Tensor& tensor) const {
  return by_impl_.count(tensor.unsafeGetTensorImpl()) != 0;
}

void DeferredInit::bind(const torch::nn::Module& m) {
  const auto name_one = [&](const std::string& kind, const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    const auto it = by_impl_.find(t.unsafeGetTensorImpl());
    if (it == by_impl_.end() && by_name_.count(name)) return;  // bound before
    PARALLAX_CHECK(it != by_impl_.end(), Error,
                   "deferred construction: {} '{}' has no recipe (the model created it outside "
                   "units::init_tensor and units::layer, units/param_init.h)",
                   kind, name);
    by_name_[name] = it->second.second;
  };
  for (const auto& item : m.named_parameters()) name_one("parameter", item.key(), item.value());
  for (const auto& item : m.named_buffers()) name_one("buffer", item.key(), item.value());
  by_impl_.clear();
}

at::Tensor DeferredInit::value(const std::string& name) const {
  const auto it = by_name_.find(name);
  PARALLAX_CHECK(it != by_name_.end(), Error, "deferred construction: no recipe for '{}'", name);
  const Recipe& r = *it->second;
  at::NoGradGuard no_grad;
  if (!r.state.defined()) return r.make().detach();
  // Replayed from the state the full build drew it at; the generator is put back after.
  auto cpu = at::detail::getDefaultCPUGenerator();
  at::Tensor saved;
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    saved = cpu.get_state();
    cpu.set_state(r.state);
  }
  const auto restore = [&] {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(saved);
  };
  at::Tensor v;
  try {
    v = r.make().detach();
  } catch (...) {
    restore();
    throw;
  }
  restore();
  return v;
}

at::Tensor init_tensor(c10::IntArrayRef shape, std::function<at::Tensor()> make) {
  if (t_shape_only) return at::empty(shape, at::TensorOptions().device(at::kMeta));
  if (t_deferred == nullptr) return make();
  at::Tensor state = cpu_generator_state();
  at::ScalarType dtype;
  int64_t bytes = 0;
  {
    at::Tensor drawn = make();  // the full build's draws, dropped at once
    dtype = drawn.scalar_type();
    bytes = static_cast<int64_t>(drawn.nbytes());
  }
  if (bytes >= kReleaseBytes) release_free_memory();
  at::Tensor p = placeholder(shape, at::TensorOptions().dtype(dtype));
  t_deferred->record(p, std::move(state), std::move(make));
  return p;
}

at::Tensor init_normal(c10::IntArrayRef shape, double std) {
  const std::vector<int64_t> s = shape.vec();
  return init_tensor(shape, [s, std]() { return at::randn(s) * std; });
}

at::Tensor init_zeros(c10::IntArrayRef shape) {
  const std::vector<int64_t> s = shape.vec();
  return init_tensor(shape, [s]() { return at::zeros(s); });
}

void init_modify(at::Tensor t, std::function<void(at::Tensor&)> fn) {
  if (t_shape_only) return;
  if (t_deferred != nullptr) {
    t_deferred->then(t, std::move(fn));
    return;
  }
  at::NoGradGuard no_grad;
  fn(t);
}

void finish_deferred(torch::nn::Module& m) {
  if (t_deferred == nullptr) return;
  at::NoGradGuard no_grad;
  const auto keep = [](at::Tensor t) {
    if (t_deferred->recorded(t)) return;
    at::Tensor value = t.detach().clone();
    t_deferred->record(t, at::Tensor(), [value]() { return value.clone(); });
    t.set_data(placeholder(t.sizes(), t.options()));
  };
  for (const auto& p : m.parameters()) keep(p);
  for (const auto& b : m.buffers()) keep(b);
  t_deferred->bind(m);
}

void place_deferred(torch::nn::Module& m, const DeferredInit& recipes, const c10::Device& device) {
  at::NoGradGuard no_grad;
  for (const auto& item : m.named_buffers()) {
    at::Tensor b = item.value();
    b.set_data(recipes.value(item.key()).to(b.scalar_type()).to(device));
  }
  if (device.is_cpu()) return;
  for (const auto& item : m.named_parameters()) {
    at::Tensor p = item.value();
    p.set_data(placeholder(p.sizes(), p.options().device(device)));
  }
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

}  // namespace parallax::units
