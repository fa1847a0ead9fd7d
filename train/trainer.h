// The training loop: config in; trained model, metrics, plots and the resolved config out.
//
// Trainer is the loop over a run assembled by build_run() (train/run.h), with the extension
// points (TrainerHooks) that the QAT, LoRA and distillation extensions (train/extension.h) build
// on: a model transform before the parallel engine wraps the model, extra loss terms, a second
// frozen model, and extra checkpoint entries. run_training() trains with the hooks of the
// extension the config turns on (none: the plain trainer).
//
// run_training() is collective: every rank of the World calls it with the same config. build_run
// makes the communicators and the DP x TP x PP topology, the model (on CPU or the rank's GPU),
// the engine with its optimizer, the precision policy and the per-rank batch source; the loop
// (train/loop.h) then runs `train.steps` optimizer steps of `train.grad_accum` micro-steps each.
// Rank 0 writes runs/<name>/config.yaml, metrics.jsonl and plots/ and prints progress lines with
// ETA.
//
// Errors: ConfigError/LayoutError before training starts; NumericsError on a non-finite loss (the
// message names the step; metrics logged so far are kept); CommError/TimeoutError from the
// communicators; DataError from the loader.
#pragma once

#include "train/run_config.h"
#include "train/trainer_hooks.h"

#include <memory>

namespace parallax::train {

// The training loop with hooks. Collective: every rank constructs one with the same config and
// calls fit(). Runs on the process's World (comm::World::current()).
class Trainer {
 public:
  explicit Trainer(RunConfig& cfg, TrainerHooks hooks = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Sets up (communicators, plan, model, engine, data, resume) and trains `train.steps` steps.
  TrainSummary fit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The plain trainer: Trainer(cfg).fit().
TrainSummary run_training(RunConfig& cfg);

}  // namespace parallax::train
