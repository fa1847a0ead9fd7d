// `parallax plan --calibrate` (train/planner.h is the planner's API): the compute efficiency,
// fixed cost and host floor measured with training steps of the model in this process.
#pragma once

#include "train/planner_types.h"
#include "train/run_config.h"

#include <cstdint>

namespace parallax::train::planner {

// Measures this machine: `steps` steps of the real training loop (one process, benchmark mode) at
// micro-batch `batch` (0: data.batch_size) and doublings of it until the step time grows give the
// compute efficiency against `hw.peak_tflops` (the slope), the fixed cost per micro-batch (the
// intercept) and the host floor (the smallest batch's step). On the CPU the peak itself is
// measured with a GEMM. Needs the process's comm::World (the trainer runs on it).
Hardware calibrate(const RunConfig& cfg, Hardware hw, int steps = 12, int64_t batch = 0);

}  // namespace parallax::train::planner
