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

PrecisionPolicy PrecisionPolicy::from(const PrecisionConfig& cfg, c10::DeviceType device_type) {
  PrecisionPolicy p;
  p.mode_ = core::parse_enum(kPrecisions, cfg.mode, "precision.mode", "mode");
  p.device_type_ = device_type;
  p.scaler_ = LossScaler(p.mode_ == Precision::kFp16, cfg.loss_scale_init,
                         cfg.loss_scale_growth_interval, cfg.loss_scale_min);
  // Parsed whatever the mode, so that a wrong recipe is named before any run starts.
  p.fp8_.recipe = kernels::fp8::parse_recipe(cfg.fp8.recipe, "precision.fp8.recipe");
  p.fp8_.amax_history = cfg.fp8.amax_history;
  return p;
}

void PrecisionPolicy::attach_fp8(std::vector<kernels::fp8::Fp8LinearImpl*> layers,
                                 kernels::fp8::AmaxReducer reduce_over_replicas) {
  fp8_layers_ = std::move(layers);
  fp8_reduce_ = std::move(reduce_over_replicas);
}

void PrecisionPolicy::fp8_histories_loaded() {
  for (auto* l : fp8_layers_) l->history_loaded();
}

void PrecisionPolicy::after_step(bool found_inf) {
  scaler_.update(found_inf);
  // The delayed recipe's amaxes of this step into the histories (kernels/fp8.h).
  if (!fp8_layers_.empty()) kernels::fp8::roll_histories(fp8_layers_, fp8_reduce_);
}

AutocastGuard::AutocastGuard(const PrecisionPolicy& policy) : device_type_(policy.device_type()) {
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
