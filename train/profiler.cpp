#include "train/profiler.h"

#include "core/error.h"
#include "core/log.h"

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <filesystem>
#include <set>

namespace parallax::train {

namespace {

using torch::profiler::impl::ActivityType;

std::set<ActivityType> activities(bool cuda) {
  std::set<ActivityType> a{ActivityType::CPU};
  if (cuda) a.insert(ActivityType::CUDA);
  return a;
}

torch::profiler::impl::ProfilerConfig config() {
  return torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO,
                                               /*report_input_shapes=*/true);
}

}  // namespace

StepProfiler::StepProfiler(int64_t start, int64_t steps, bool cuda, std::string path)
    : start_(start), end_(start + steps), cuda_(cuda), path_(std::move(path)) {
  if (steps > 0) torch::autograd::profiler::prepareProfiler(config(), activities(cuda_));
}

StepProfiler::~StepProfiler() {
  if (!active_) return;
  try {
    stop();
  } catch (const std::exception& e) {
    core::log::warn("profiler: {}", e.what());
  }
}

void StepProfiler::before(int64_t step) {
  if (step != start_ || end_ <= start_) return;
  if (cuda_) torch::cuda::synchronize();
  torch::autograd::profiler::enableProfiler(config(), activities(cuda_));
  active_ = true;
  core::log::info("profiler: recording steps {} to {}", start_, end_ - 1);
}

void StepProfiler::after(int64_t step) {
  if (active_ && step == end_ - 1) stop();
}

void StepProfiler::stop() {
  if (cuda_) torch::cuda::synchronize();
  active_ = false;
  auto result = torch::autograd::profiler::disableProfiler();
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path_).parent_path(), ec);
  if (ec)
    throw_error<IoError>("profiler: cannot create the folder of '{}': {}", path_, ec.message());
  result->save(path_);
  PARALLAX_CHECK(std::filesystem::exists(path_), IoError,
                 "profiler: the trace '{}' was not written", path_);
  core::log::info("profiler: trace of steps {} to {} in {}", start_, end_ - 1, path_);
}

}  // namespace parallax::train
