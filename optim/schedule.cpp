#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

namespace parallax::optim {

double lr_at(const ScheduleConfig& cfg, double peak_lr, int64_t step, int64_t total_steps) {
  const double min_lr = cfg.min_lr_ratio * peak_lr;
  if (cfg.warmup_steps > 0 && step <= cfg.warmup_steps) {
    return peak_lr * static_cast<double>(step) / static_cast<double>(cfg.warmup_steps);
  }
  if (cfg.name == "constant") return peak_lr;
  const int64_t decay_steps = std::max<int64_t>(1, total_steps - cfg.warmup_steps);
  const double t = std::clamp(static_cast<double>(step - cfg.warmup_steps) / decay_steps, 0.0, 1.0);
  if (cfg.name == "linear") return peak_lr + (min_lr - peak_lr) * t;
  return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + std::cos(M_PI * t));  // cosine
}

}  // namespace parallax::optim
