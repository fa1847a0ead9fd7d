// Step profiler for `parallax train`: train.profile_steps > 0 records steps
// [profile_start, profile_start + profile_steps) with LibTorch's Kineto profiler (host ops and,
// on GPUs, every CUDA kernel and copy) and writes a Chrome trace per rank, which
// chrome://tracing, Perfetto or TensorBoard's profiler plugin open, and which
// bench/train/trace_summary.py breaks down by kernel class.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace parallax::train {

class StepProfiler {
 public:
  // steps == 0: disabled (every call is a no-op). `path`: the trace file to write.
  StepProfiler(int64_t start, int64_t steps, bool cuda, std::string path);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Call before step `step` runs and after it finished; `after` synchronizes the device at the
  // window's ends so the trace holds exactly the window's kernels.
  void before(int64_t step);
  void after(int64_t step);
  bool active() const { return active_; }

 private:
  void stop();
  int64_t start_, end_;
  bool cuda_;
  std::string path_;
  bool active_ = false;
};

}  // namespace parallax::train
