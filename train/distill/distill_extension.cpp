// Distillation as a trainer extension (train/extension.h): its config section and hooks. A
// distilled run's checkpoints hold the student alone, which eval and export read as a plain
// run's model.
#include "train/distill/distill.h"
#include "train/extension.h"
#include "train/run_config.h"

#include <fmt/format.h>

namespace parallax::train::distill {

namespace {

class DistillExtension final : public Extension {
 public:
  const char* name() const override { return "distill"; }
  ConfigSection section() const override { return ConfigSection::of<DistillConfig>("distill"); }
  const char* title() const override { return "distillation"; }
  bool enabled(const RunConfig& cfg) const override { return !config(cfg).teacher.empty(); }
  const char* key() const override { return "distill.teacher"; }
  std::string key_value(const RunConfig& cfg) const override {
    return fmt::format("distill.teacher='{}'", config(cfg).teacher);
  }
  TrainerHooks hooks(const RunConfig& cfg) const override { return distill::hooks(cfg); }
  void plan_transforms(parallel::Plan::Transforms& t) const override { t.distill = true; }
};

}  // namespace

const DistillConfig& config(const RunConfig& cfg) {
  return cfg.extensions.get<DistillConfig>();
}

DistillConfig& config(RunConfig& cfg) {
  return cfg.extensions.get<DistillConfig>();
}

const Extension& extension() {
  static const DistillExtension e;
  return e;
}

}  // namespace parallax::train::distill
