#include "core/error.h"
#include "models/mlp.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "models/recompute.h"
#include "models/vit.h"
#include "units/param_init.h"

#include <ATen/Context.h>
#include <ATen/SDPBackend.h>

#include <algorithm>
#include <map>

namespace parallax::models {

namespace {

struct MlpShape {
  int64_t in, hidden, out, depth;
};

MlpShape mlp_shape(const std::string& size) {
  if (size == "tiny") return {32, 64, 8, 2};
  if (size == "small") return {256, 1024, 64, 4};
  throw_error<ConfigError>("key 'model.size': model 'mlp' has sizes tiny|small, got '{}'", size);
}

// b16: ViT-B/16 at 224 x 224, as timm's vit_base_patch16_224. tiny: the same image and patch size
// with 2 narrow blocks (CPU tests, e.g. the ONNX export's parity test).
VitSpec vit_cls_spec(const ModelConfig& cfg) {
  PARALLAX_CHECK(cfg.size == "b16" || cfg.size == "tiny", ConfigError,
                 "key 'model.size': model 'vit_cls' has sizes tiny|b16, got '{}'", cfg.size);
  VitSpec spec;
  if (cfg.size == "tiny") {
    spec.dim = 96;
    spec.depth = 2;
    spec.heads = 4;  // divisible by tp 2 and 4 (tensor-parallel tests)
    spec.mlp_hidden = 384;
  }
  return spec;
}

}  // namespace

std::vector<double> Model::stage_costs() const {
  std::vector<double> costs = unit_flops();
  const std::vector<Unit> u = units();
  if (costs.size() == u.size()) return costs;
  std::map<std::string, int64_t> numel;
  for (const auto& item : named_parameters()) numel[item.key()] = item.value().numel();
  costs.clear();
  for (const auto& unit : u) {
    double c = 1;
    for (const auto& n : unit.param_names) c += static_cast<double>(numel.at(n));
    costs.push_back(c);
  }
  return costs;
}

std::vector<double> Model::saved_activations(const ActivationQuery& q, Recompute mode,
                                             std::vector<bool>* recomputed) const {
  const std::vector<UnitActivation> units = unit_activations(q);
  std::vector<double> saved(units.size(), 0.0);
  if (recomputed) recomputed->assign(units.size(), false);
  int block = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    saved[u] = units[u].saved;
    for (const auto& inner : units[u].inner) {
      if (!recomputed_block(mode, block++)) continue;
      saved[u] -= inner.saved - inner.input;
      if (recomputed) (*recomputed)[u] = true;
    }
    if (!units[u].recomputable || !recomputed_block(mode, block++)) continue;
    saved[u] = u > 0 ? units[u - 1].output : 0;  // a wrapped block keeps only its input
    if (recomputed) (*recomputed)[u] = true;
  }
  return saved;
}

std::pair<int, int> Model::apply_recompute(Recompute mode) {
  int blocks = 0, wrapped = 0;
  for (const auto& block : recomputable_blocks()) {
    auto cb = std::dynamic_pointer_cast<RecomputableBlock>(block);
    if (cb && recomputed_block(mode, blocks)) {
      cb->set_recompute(true);
      ++wrapped;
    }
    ++blocks;
  }
  return {wrapped, blocks};
}

int64_t Model::parameter_count() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

std::shared_ptr<Model> build_model(const ModelConfig& cfg, const core::SceneSpec& scene) {
  return build_model(cfg, scene, dense_linear);
}

void set_attention_backend(const std::string& name) {
  using B = at::SDPBackend;
  // LibTorch's own order, captured once so that "auto" restores it after another choice.
  static const auto kDefault = at::globalContext().sDPPriorityOrder();
  std::vector<B> order(kDefault.begin(), kDefault.end());
  const std::map<std::string, B> by_name = {{"cudnn", B::cudnn_attention},
                                            {"flash", B::flash_attention},
                                            {"efficient", B::efficient_attention},
                                            {"math", B::math}};
  // FlashAttention-3 is a variant of the flash backend that this LibTorch may or may not have.
  constexpr bool kHasFa3 = requires(at::Context & c) {
    c.setSDPUseFA3(true);
  };
  if constexpr (kHasFa3) at::globalContext().setSDPUseFA3(name == "fa3");
  PARALLAX_CHECK(
      name != "fa3" || kHasFa3, ConfigError,
      "key 'model.attention': fa3 needs a LibTorch with FlashAttention-3 (this one has none)");
  if (name != "auto") {
    const auto it = by_name.find(name == "fa3" ? "flash" : name);
    PARALLAX_CHECK(it != by_name.end(), ConfigError,
                   "key 'model.attention': expected auto|cudnn|flash|fa3|efficient|math, got '{}'",
                   name);
    order.erase(std::find(order.begin(), order.end(), it->second));
    order.insert(order.begin(), it->second);
  }
  std::vector<int64_t> ids;
  for (B b : order) ids.push_back(static_cast<int64_t>(b));
  at::globalContext().setSDPPriorityOrder(ids);
}

namespace {

// A model as built: under shape-only construction (units/param_init.h) the LibTorch layers
// allocated, which is dropped now; under deferred construction the rest of their tensors are kept
// as values and every recipe is named.
std::shared_ptr<Model> finished(std::shared_ptr<Model> model) {
  if (units::shape_only()) units::to_meta(*model);
  units::finish_deferred(*model);
  return model;
}

std::shared_ptr<Model> build_unchecked(const ModelConfig& cfg, const core::SceneSpec& scene,
                                       const LinearFactory& linear) {
  set_attention_backend(cfg.attention);
  if (cfg.name == "mlp") {
    const MlpShape s = mlp_shape(cfg.size);
    return std::make_shared<MlpModel>(s.in, s.hidden, s.out, s.depth);
  }
  if (cfg.name == "vit_cls") {
    VitSpec spec = vit_cls_spec(cfg);
    spec.dropout = cfg.dropout;
    spec.fp32_residual = cfg.fp32_residual;
    spec.fused_kernels = cfg.fused_kernels;
    return std::make_shared<VitClassifier>(spec, 224, cfg.num_classes, linear);
  }
  if (cfg.name == "bev")
    return std::make_shared<PerceptionModel>(make_bev_spec(cfg, scene), linear);
  throw_error<ConfigError>("key 'model.name': expected bev|vit_cls|mlp, got '{}'", cfg.name);
}

}  // namespace

std::shared_ptr<Model> build_model(const ModelConfig& cfg, const core::SceneSpec& scene,
                                   const LinearFactory& linear) {
  return finished(build_unchecked(cfg, scene, linear));
}

std::shared_ptr<Model> build_model(const ModelConfig& cfg, const core::SceneSpec& scene,
                                   const units::TpLayersPtr& tp) {
  if (!tp) return build_model(cfg, scene);
  const bool vit_bev = cfg.name == "bev" && make_bev_spec(cfg, scene).encoder.backbone == "vit";
  PARALLAX_CHECK(cfg.name == "vit_cls" || vit_bev, ConfigError,
                 "key 'parallel.tp': TP splits ViT blocks only, and model '{}'{} has none; use "
                 "parallel.tp=1{}",
                 cfg.name,
                 cfg.name == "bev" ? fmt::format(" with the {} backbone (model.backbone={})",
                                                 cfg.backbone, cfg.backbone)
                                   : "",
                 cfg.name == "bev" ? " or model.backbone=vit" : "");
  set_attention_backend(cfg.attention);
  const LinearFactory linear = tp->linear_factory();
  if (cfg.name == "vit_cls") {
    VitSpec spec = vit_cls_spec(cfg);
    spec.dropout = cfg.dropout;
    spec.fp32_residual = cfg.fp32_residual;
    spec.fused_kernels = cfg.fused_kernels;
    return finished(std::make_shared<VitClassifier>(spec, 224, cfg.num_classes, linear, tp));
  }
  return finished(std::make_shared<PerceptionModel>(make_bev_spec(cfg, scene), linear, tp));
}

std::vector<ModuleCost> analytic_cost(const ModelConfig& cfg, const core::SceneSpec& scene) {
  if (cfg.name == "mlp") {
    const MlpShape s = mlp_shape(cfg.size);
    int64_t params = 0, width = s.in;
    for (int64_t i = 0; i < s.depth; ++i) {
      params += width * s.hidden + s.hidden;
      width = s.hidden;
    }
    params += width * s.out + s.out;
    // Matches MlpModel::forward_flops_per_sample().
    double flops = 0;
    width = s.in;
    for (int64_t i = 0; i < s.depth; ++i) {
      flops += 2.0 * width * s.hidden;
      width = s.hidden;
    }
    return {{"mlp", params, flops + 2.0 * width * s.out}};
  }
  if (cfg.name == "vit_cls") {
    const VitSpec spec = vit_cls_spec(cfg);
    const Cost vit = VisionTransformerImpl::analytic_cost({spec, 224, 224, true, dense_linear});
    const Cost head = linear_cost(spec.dim, cfg.num_classes, true, 1);
    return {{"vit", vit.params, vit.flops}, {"head", head.params, head.flops}};
  }
  if (cfg.name == "bev") return PerceptionModel::analytic_cost(make_bev_spec(cfg, scene));
  throw_error<ConfigError>("key 'model.name': expected bev|vit_cls|mlp, got '{}'", cfg.name);
}

}  // namespace parallax::models
