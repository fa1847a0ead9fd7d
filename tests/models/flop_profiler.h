// An independent FLOP count for tests: LibTorch's profiler (Kineto, with_flops) reports the FLOPs
// of each conv2d / mm / addmm / bmm it sees from the actual input shapes. Attention inside SDPA,
// norms and elementwise ops are not included.
#pragma once

#include <torch/csrc/autograd/profiler_kineto.h>

#include <functional>
#include <set>
#include <string>

namespace parallax::models::testing {

// Sum of profiler-reported FLOPs of matmul and convolution ops run by `fn` (CPU).
inline double profiled_matmul_conv_flops(const std::function<void()>& fn) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  using torch::profiler::impl::ProfilerConfig;
  using torch::profiler::impl::ProfilerState;
  const ProfilerConfig cfg(ProfilerState::KINETO, /*report_input_shapes=*/true, false, false,
                           /*with_flops=*/true);
  const std::set<ActivityType> acts{ActivityType::CPU};
  prof::prepareProfiler(cfg, acts);
  prof::enableProfiler(cfg, acts);
  fn();
  auto result = prof::disableProfiler();
  static const std::set<std::string> kOps = {"aten::conv2d", "aten::mm", "aten::addmm", "aten::bmm",
                                             "aten::baddbmm"};
  double flops = 0;
  for (const auto& e : result->events()) {
    if (kOps.count(e.name())) flops += static_cast<double>(e.flops());
  }
  return flops;
}

}  // namespace parallax::models::testing
