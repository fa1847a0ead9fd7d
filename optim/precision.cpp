#include "optim/precision.h"

#include <ATen/autocast_mode.h>

namespace parallax::optim {

PrecisionPolicy make_precision_policy(const PrecisionConfig& cfg, c10::DeviceType device_type) {
  PrecisionPolicy p;
  p.mode = cfg.mode;
  p.device_type = device_type;
  return p;
}

LossScaler make_loss_scaler(const PrecisionConfig& cfg) {
  return LossScaler(cfg.mode == "fp16", cfg.loss_scale_init, cfg.loss_scale_growth_interval,
                    cfg.loss_scale_min);
}

AutocastGuard::AutocastGuard(const PrecisionPolicy& policy) : device_type_(policy.device_type) {
  if (!policy.autocast()) return;
  active_ = true;
  prev_enabled_ = at::autocast::is_autocast_enabled(device_type_);
  prev_dtype_ = at::autocast::get_autocast_dtype(device_type_);
  at::autocast::set_autocast_enabled(device_type_, true);
  at::autocast::set_autocast_dtype(device_type_, policy.compute_dtype());
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_type_, prev_dtype_);
}

}  // namespace parallax::optim
