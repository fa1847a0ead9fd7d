// The precision policy of a run, one object for the trainer and the engines:
//   fp32: no autocast, no loss scaling;
//   bf16: autocast to bf16 on the compute device, fp32 parameters (the master weights), no scaling;
//   fp16: autocast to fp16, fp32 parameters, dynamic loss scaling (LossScaler);
//   fp8: bf16's policy, and the ViT blocks' linear layers run their GEMMs in FP8 (kernels/fp8.h,
//        applied to the model by the trainer; precision.fp8 says how tensors are scaled).
// Parameters stay fp32 in all three modes, so they are their own master weights; parameters
// stored in low precision (an engine's choice, e.g. ZeRO-3 flat buffers) get fp32 masters in the
// Optimizer.
#pragma once

#include "optim/grad_utils.h"
#include "optim/optim_config.h"

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace parallax::optim {

// precision.mode, parsed once (parse_precision).
enum class Precision { kFp32, kBf16, kFp16, kFp8 };
// "fp32" | "bf16" | "fp16" | "fp8".
const char* to_string(Precision mode);
// ConfigError naming precision.mode for an unknown name.
Precision parse_precision(const std::string& name);

struct PrecisionPolicy {
  Precision mode = Precision::kFp32;
  c10::DeviceType device_type = c10::DeviceType::CPU;

  bool autocast() const { return mode != Precision::kFp32; }
  c10::ScalarType compute_dtype() const {
    return mode == Precision::kBf16 || mode == Precision::kFp8 ? c10::ScalarType::BFloat16
           : mode == Precision::kFp16                          ? c10::ScalarType::Half
                                                               : c10::ScalarType::Float;
  }
  // Bytes of an autocast activation (2 under bf16/fp16, 4 without autocast).
  int compute_bytes() const { return autocast() ? 2 : 4; }
  bool loss_scaling() const { return mode == Precision::kFp16; }
  bool fp8() const { return mode == Precision::kFp8; }
};

PrecisionPolicy make_precision_policy(const PrecisionConfig& cfg, c10::DeviceType device_type);
LossScaler make_loss_scaler(const PrecisionConfig& cfg);

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
