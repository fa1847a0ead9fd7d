// QAT as a trainer extension (train/extension.h): its config section, hooks, and the model of a
// QAT run restored for eval and export (fake-quantized with the checkpoint's amax).
#include "checkpoint/weights.h"
#include "models/model.h"
#include "train/extension.h"
#include "train/qat/qat.h"
#include "train/run_config.h"

#include <fmt/format.h>

namespace parallax::train::qat {

namespace {

class QatExtension final : public Extension {
 public:
  const char* name() const override { return "qat"; }
  ConfigSection section() const override { return ConfigSection::of<QatConfig>("qat"); }
  const char* title() const override { return "QAT"; }
  bool enabled(const RunConfig& cfg) const override { return config(cfg).enabled; }
  const char* key() const override { return "qat.enabled"; }
  std::string key_value(const RunConfig& cfg) const override {
    return fmt::format("qat.enabled={}", config(cfg).enabled);
  }
  TrainerHooks hooks(const RunConfig& cfg) const override { return qat::hooks(cfg); }
  void plan_transforms(parallel::Plan::Transforms& t) const override { t.qat = true; }
  // A QAT run's checkpoints hold the quantizers' amax: the model is evaluated and exported
  // fake-quantized.
  std::shared_ptr<models::Model> restore(const RunConfig& cfg, const core::SceneSpec& scene,
                                         const std::string& source,
                                         std::string& loaded) const override {
    std::shared_ptr<models::Model> model = models::build_model(cfg.model, scene);
    const std::vector<Layer> quantized = apply(*model, config(cfg));
    loaded = checkpoint::load_weights(*model, source).summary();
    set_state(quantized, models::QuantState::kQuantizing);
    return model;
  }
};

}  // namespace

const QatConfig& config(const RunConfig& cfg) {
  return cfg.extensions.get<QatConfig>();
}

QatConfig& config(RunConfig& cfg) {
  return cfg.extensions.get<QatConfig>();
}

const Extension& extension() {
  static const QatExtension e;
  return e;
}

}  // namespace parallax::train::qat
