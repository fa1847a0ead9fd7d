// Learning-rate schedules: linear warmup from 0 to the peak, then cosine, linear or constant decay
// to `min_lr_ratio * peak` at the last step. Pure functions of the step: resuming needs no state.
#pragma once

#include "optim/optim_config.h"

#include <cstdint>

namespace parallax::optim {

// LR for optimizer step `step` (1-based: the first update uses step 1) of `total_steps`.
double lr_at(const ScheduleConfig& cfg, double peak_lr, int64_t step, int64_t total_steps);

}  // namespace parallax::optim
