// The training loop: config in; trained model, metrics, plots and the resolved config out.
//
// run_training() is collective: every rank of the World calls it with the same config. It builds
// the communicators and the DP x TP x PP topology, the model (on CPU or the rank's GPU), the DDP
// engine when dp > 1, the optimizer, LR schedule, precision policy and loss scaler, and the
// per-rank batch source; then runs `train.steps` optimizer steps of `train.grad_accum`
// micro-steps each. Rank 0 writes runs/<name>/config.yaml, metrics.jsonl and plots/ and prints
// progress lines with ETA.
//
// Errors: ConfigError/LayoutError before training starts; NumericsError on a non-finite loss (the
// message names the step; metrics logged so far are kept); CommError/TimeoutError from the
// communicators; DataError from the loader.
#pragma once

#include "train/run_config.h"

#include <functional>
#include <string>

namespace parallax::train {

struct TrainSummary {
  std::string run_dir;
  int64_t steps = 0;
  double final_loss = 0;  // mean over the data-parallel group at the last step (NaN: none trained)
  double samples_per_s = 0;    // global throughput over the run (after the first step)
};

// Runs on the process's World (parallel::comm::World::current()).
TrainSummary run_training(RunConfig& cfg);

}  // namespace parallax::train
