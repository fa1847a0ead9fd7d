// Internal to the trainer (train/trainer.h is the API): the training loop over an assembled run
// (train/run.h). The loop only orders the step and asks its components: the step
// (train/step.h), the step metrics (train/step_metrics.h) and the cadence (train/cadence.h:
// evaluation, checkpoints, profiling, preemption). It knows no parallelism, precision or
// extension by name: those are the run's engine, precision policy and hooks.
#pragma once

#include "train/run.h"
#include "train/trainer_hooks.h"

namespace parallax::train::detail {

class Loop {
 public:
  explicit Loop(Run& run) : run_(run) {}
  // Prepares (TrainerHooks::prepare), then trains to the run's last step. Collective.
  TrainSummary fit();

 private:
  // TrainerHooks::prepare, then its metrics row; false (on every rank) when a preemption signal
  // stopped it (train/preemption.h).
  bool prepare();
  // A run that takes no optimizer step (TrainerHooks::trains false): evaluated and saved once.
  TrainSummary without_steps();
  // train.steps, or train.epochs over the dataset.
  int64_t total_steps() const;

  Run& run_;
};

}  // namespace parallax::train::detail
