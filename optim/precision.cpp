#include "optim/precision.h"

#include "core/enum_names.h"

#include <ATen/autocast_mode.h>

namespace parallax::optim {

namespace {
constexpr core::EnumName<Precision> kPrecisions[] = {
    {Precision::kFp32, "fp32"},
    {Precision::kBf16, "bf16"},
    {Precision::kFp16, "fp16"},
    {Precision::kFp8, "fp8"},
};
}  // namespace

const char* to_string(Precision mode) {
  return core::enum_name(kPrecisions, mode);
}

Precision parse_precision(const std::string& name) {
  return core::parse_enum(kPrecisions, name, "precision.mode", "mode");
}

PrecisionPolicy make_precision_policy(const PrecisionConfig& cfg, c10::DeviceType device_type) {
  PrecisionPolicy p;
  p.mode = parse_precision(cfg.mode);
  p.device_type = device_type;
  return p;
}

LossScaler make_loss_scaler(const PrecisionConfig& cfg) {
  return LossScaler(parse_precision(cfg.mode) == Precision::kFp16, cfg.loss_scale_init,
                    cfg.loss_scale_growth_interval, cfg.loss_scale_min);
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
