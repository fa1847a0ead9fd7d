// The training loop: config in, trained model, metrics and resolved config out.
#pragma once

#include "train/run_config.h"

#include <string>

namespace parallax::train {

struct TrainSummary {
  std::string run_dir;
  int64_t steps = 0;
  double final_loss = 0;
};

// Trains as `cfg` says: creates <output_dir>/<name>/, writes config.yaml and metrics.jsonl, logs
// progress with ETA. Throws parallax::Error subclasses on bad input or divergence (NaN loss).
TrainSummary run_training(RunConfig& cfg);

}  // namespace parallax::train
