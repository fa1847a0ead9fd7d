// The pipeline's stage partition: which contiguous run of the model's units each stage runs. One
// function for the engine (parallel/pipeline/pipeline_engine.h cuts the model with it) and the
// planner (train/planner.cpp predicts the trainer's split by calling it with the same inputs), so
// the plan's memory per stage is the run's.
//
// Thread-safety: a plain function. Errors: ConfigError naming the keys and numbers.
#pragma once

#include <vector>

namespace parallax::parallel::pipeline {

// The stages' unit ranges: stage s runs units [bounds[s], bounds[s + 1]). `costs[u]`: unit u's
// cost (any positive measure); `explicit_counts` (parallel.pp_layout), when not empty, gives the
// number of units of each stage. Otherwise the split is contiguous and minimises the largest
// stage cost (the step's critical path); among the splits that reach that minimum, it takes the
// one whose largest activation footprint, in_flight[s] x the sum of `activation_bytes` over
// stage s's units, is smallest (when both are given: one value per unit, one per stage, e.g.
// Model::saved_activations and in_flight_per_stage: under 1F1B the first stage holds pp
// micro-batches and the last one, so heavy units move towards the end where that costs no time).
// ConfigError naming the keys and numbers: fewer units than stages, a layout of the wrong length,
// a stage of no units, counts that do not sum to the units.
std::vector<int> partition(const std::vector<double>& costs, int stages,
                           const std::vector<int>& explicit_counts = {},
                           const std::vector<double>& activation_bytes = {},
                           const std::vector<int>& in_flight = {});

}  // namespace parallax::parallel::pipeline
