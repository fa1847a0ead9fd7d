// Trainer extensions (ARCHITECTURE §5, "Extensions"): QAT, LoRA, distillation, and what comes
// next, each in a folder of its own (train/qat/, train/lora/, train/distill/). An extension
// registers its config section (train/config_sections.h), its model transform and its hooks into
// the loop (TrainerHooks), and what `parallax eval`, `parallax export` and `parallax plan` need of
// it. build_run(), the loop and the run config reach them only through this interface;
// train/extensions.cpp is the one file that lists them.
//
// At most one extension is active in a run (active_extension()): they are separate trainers in
// this version.
//
// Thread-safety: the registry is immutable after the first call; extensions hold no state.
#pragma once

#include "core/scene.h"
#include "parallel/plan.h"
#include "train/config_sections.h"
#include "train/trainer_hooks.h"

#include <memory>
#include <string>
#include <vector>

namespace parallax::models {
class Model;
}

namespace parallax::train {

struct RunConfig;

class Extension {
 public:
  virtual ~Extension() = default;

  // Its config section: "qat", "lora", "distill"; its default values (train/config_sections.h).
  virtual const char* name() const = 0;
  virtual ConfigSection section() const = 0;
  // Its name in messages ("QAT", "LoRA", "distillation").
  virtual const char* title() const = 0;
  // Whether `cfg` turns it on; the key that does ("qat.enabled"), and that key with its value
  // ("qat.enabled=true"), for the error that names two active extensions.
  virtual bool enabled(const RunConfig& cfg) const = 0;
  virtual const char* key() const = 0;
  virtual std::string key_value(const RunConfig& cfg) const = 0;

  // Training: the hooks the loop calls (train/trainer.h).
  virtual TrainerHooks hooks(const RunConfig& cfg) const = 0;
  // The layouts it runs under, for parallel::Plan::from's checks.
  virtual void plan_transforms(parallel::Plan::Transforms& transforms) const = 0;

  // eval and export: the model of a run of this extension, with the weights of `source` (a
  // checkpoint directory or a weights.h5), on the CPU; `loaded` says what was read. nullptr: the
  // model is built and loaded as a plain run's is.
  virtual std::shared_ptr<models::Model> restore(const RunConfig& cfg, const core::SceneSpec& scene,
                                                 const std::string& source,
                                                 std::string& loaded) const;
  // plan: whether `parallax plan`'s memory model covers it (false: plan refuses the config).
  virtual bool planned() const { return false; }
  // plan: the transform on a shape-only model (no parameter materialised) with tensor-parallel
  // degree `tp`, as the trainer applies it. ConfigError where the extension cannot run so, naming
  // the keys. By default nothing.
  virtual void transform_shape_only(models::Model& model, const RunConfig& cfg, int tp) const;
};

// Every registered extension, in the order of their config sections.
const std::vector<const Extension*>& extensions();
// The extension `cfg` turns on, or nullptr. ConfigError naming the keys when several are on.
const Extension* active_extension(const RunConfig& cfg);
// The model transforms `cfg` applies (the active extension's: train/extension.h), for
// parallel::Plan::from's checks of the layouts each runs under.
parallel::Plan::Transforms plan_transforms(const RunConfig& cfg);

}  // namespace parallax::train
