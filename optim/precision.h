// The precision policy of a run: ONE object, built once from the `precision` section
// (PrecisionPolicy::from, the only place precision.mode is parsed), that owns every decision a
// run makes about number formats:
//   - autocast: fp32 none; bf16 and fp8 autocast to bf16; fp16 autocast to fp16 (AutocastGuard);
//   - master weights: parameters stay fp32 in every mode, so they are their own masters;
//     parameters an engine stores in low precision (ZeRO-3 flat buffers) get fp32 masters in the
//     Optimizer;
//   - the loss scaler: dynamic loss scaling under fp16 only (scale_loss, unscale_and_check and the
//     update in after_step);
//   - FP8 (precision.mode=fp8): the recipe of precision.fp8 (fp8_options), and, once the model's
//     FP8 layers exist (the run assembly applies them, train/run.h), their amax histories: rolled
//     after every step (after_step) with a MAX over the replicas.
// The trainer's loop, evaluation and the engines all take this object; nothing else reads
// precision.mode.
//
// Thread-safety: one training thread. Copyable (a copy shares the FP8 layers it points at).
#pragma once

#include "kernels/fp8.h"
#include "optim/grad_utils.h"
#include "optim/optim_config.h"

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

namespace parallax::optim {

// precision.mode.
enum class Precision { kFp32, kBf16, kFp16, kFp8 };
// "fp32" | "bf16" | "fp16" | "fp8".
const char* to_string(Precision mode);

class PrecisionPolicy {
 public:
  PrecisionPolicy() = default;
  // The policy of `cfg` on devices of `device_type`. ConfigError naming precision.mode (an unknown
  // mode) or precision.fp8.recipe.
  static PrecisionPolicy from(const PrecisionConfig& cfg, c10::DeviceType device_type);

  Precision mode() const { return mode_; }
  c10::DeviceType device_type() const { return device_type_; }
  bool autocast() const { return mode_ != Precision::kFp32; }
  c10::ScalarType compute_dtype() const {
    return mode_ == Precision::kBf16 || mode_ == Precision::kFp8 ? c10::ScalarType::BFloat16
           : mode_ == Precision::kFp16                           ? c10::ScalarType::Half
                                                                 : c10::ScalarType::Float;
  }
  // Bytes of an autocast activation (2 under bf16/fp16, 4 without autocast).
  int compute_bytes() const { return autocast() ? 2 : 4; }
  bool loss_scaling() const { return mode_ == Precision::kFp16; }
  bool fp8() const { return mode_ == Precision::kFp8; }

  // The loss scaler (enabled under fp16 only): its state is checkpointed.
  LossScaler& scaler() { return scaler_; }
  const LossScaler& scaler() const { return scaler_; }
  // The loss a backward starts from: scaled under fp16, else `loss` itself.
  at::Tensor scale_loss(const at::Tensor& loss) const { return scaler_.scale_loss(loss); }
  // Unscales the gradients (fp16) and returns whether any rank found inf/NaN (LossScaler).
  bool unscale_and_check(const std::vector<GradGroup>& grads) {
    return scaler_.unscale_and_check(grads);
  }

  // FP8: the recipe of precision.fp8 (kernels/fp8.h), for the layers the run converts.
  const kernels::fp8::Fp8Options& fp8_options() const { return fp8_; }
  // FP8: the model's FP8 layers, whose delayed-recipe histories after_step() rolls, and the MAX
  // over the replicas of their amaxes (null: one replica).
  void attach_fp8(std::vector<kernels::fp8::Fp8LinearImpl*> layers,
                  kernels::fp8::AmaxReducer reduce_over_replicas);
  const std::vector<kernels::fp8::Fp8LinearImpl*>& fp8_layers() const { return fp8_layers_; }
  // After the histories were read from a checkpoint: the scales follow them from the first step.
  void fp8_histories_loaded();

  // The end of an optimizer step: the loss scale follows `found_inf` (fp16), and the step's FP8
  // amaxes go into the histories (delayed recipe). Collective over the replicas under fp8.
  void after_step(bool found_inf);

 private:
  Precision mode_ = Precision::kFp32;
  c10::DeviceType device_type_ = c10::DeviceType::CPU;
  LossScaler scaler_{false};
  kernels::fp8::Fp8Options fp8_;
  std::vector<kernels::fp8::Fp8LinearImpl*> fp8_layers_;
  kernels::fp8::AmaxReducer fp8_reduce_;
};

// PrecisionPolicy::from (the name the engines' tests know).
inline PrecisionPolicy make_precision_policy(const PrecisionConfig& cfg,
                                             c10::DeviceType device_type) {
  return PrecisionPolicy::from(cfg, device_type);
}

// RAII: enables autocast for the policy's device and dtype for the guard's lifetime (forward and
// loss), restoring the previous state and clearing the cast cache on exit. No-op for fp32.
class AutocastGuard {
 public:
  explicit AutocastGuard(const PrecisionPolicy& policy);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType device_type_;
  bool prev_enabled_ = false;
  c10::ScalarType prev_dtype_ = c10::ScalarType::Float;
};

}  // namespace parallax::optim
