// LoRA as a trainer extension (train/extension.h): its config section, hooks, the shape-only
// transform `parallax plan` models, and the model of a LoRA run restored for eval and export (the
// base with the checkpoint's adapters merged in).
#include "checkpoint/reader.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "train/extension.h"
#include "train/lora/lora.h"
#include "train/run_config.h"

#include <fmt/format.h>

namespace parallax::train::lora {

namespace {

class LoraExtension final : public Extension {
 public:
  const char* name() const override { return "lora"; }
  ConfigSection section() const override { return ConfigSection::of<LoraConfig>("lora"); }
  const char* title() const override { return "LoRA"; }
  bool enabled(const RunConfig& cfg) const override { return config(cfg).rank > 0; }
  const char* key() const override { return "lora.rank"; }
  std::string key_value(const RunConfig& cfg) const override {
    return fmt::format("lora.rank={}", config(cfg).rank);
  }
  TrainerHooks hooks(const RunConfig& cfg) const override { return lora::hooks(cfg); }
  void plan_transforms(parallel::Plan::Transforms& t) const override { t.lora = true; }
  // A LoRA run's checkpoints hold its adapters: the base (lora.base or train.load_from, checked
  // against the fingerprint the run saved) with the adapters merged in. An exported weights.h5
  // holds them merged already: the plain model reads it.
  std::shared_ptr<models::Model> restore(const RunConfig& cfg, const core::SceneSpec& scene,
                                         const std::string& source,
                                         std::string& loaded) const override {
    if (checkpoint::is_weights_file(source)) return nullptr;
    checkpoint::CheckpointReader reader(source);
    auto model = merged_model(cfg, scene, reader);
    loaded = fmt::format("LoRA adapters merged into base {}", base_path(cfg));
    return model;
  }
  bool planned() const override { return true; }
  // The adapters on the base, which is frozen; its values do not matter.
  void transform_shape_only(models::Model& model, const RunConfig& cfg, int tp) const override {
    PARALLAX_CHECK(tp == 1, ConfigError,
                   "keys 'lora.rank' and 'parallel.tp': LoRA adapts dense linear layers; use "
                   "parallel.tp=1 for LoRA in this version");
    (void)apply(model, config(cfg));
  }
};

}  // namespace

const LoraConfig& config(const RunConfig& cfg) {
  return cfg.extensions.get<LoraConfig>();
}

LoraConfig& config(RunConfig& cfg) {
  return cfg.extensions.get<LoraConfig>();
}

const Extension& extension() {
  static const LoraExtension e;
  return e;
}

}  // namespace parallax::train::lora
