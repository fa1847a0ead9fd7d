#include "core/rng.h"

#include "core/error.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>

namespace parallax::core {
namespace {

int cuda_device_count() {
  return at::hasCUDA() ? static_cast<int>(at::detail::getCUDAHooks().deviceCount()) : 0;
}

}  // namespace

void seed_all(uint64_t seed) {
  at::manual_seed(seed);
}

uint64_t derive_seed(uint64_t seed, uint64_t rank, uint64_t stream) {
  // SplitMix64 finaliser over a combination of the three inputs.
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL * (rank + 1) + 0xBF58476D1CE4E5B9ULL * (stream + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

RngState capture_rng() {
  RngState s;
  auto cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    s.cpu = cpu.get_state();
  }
  for (int i = 0; i < cuda_device_count(); ++i) {
    auto gen = at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::CUDA, i));
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.cuda.push_back(gen.get_state());
  }
  return s;
}

void restore_rng(const RngState& state) {
  auto cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(state.cpu);
  }
  const int n = cuda_device_count();
  if (!state.cuda.empty() && static_cast<int>(state.cuda.size()) != n) {
    throw_error<Error>("cannot restore RNG state saved with {} CUDA devices on a process with {}",
                       state.cuda.size(), n);
  }
  for (int i = 0; i < static_cast<int>(state.cuda.size()); ++i) {
    auto gen = at::globalContext().defaultGenerator(c10::Device(c10::DeviceType::CUDA, i));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state.cuda[i]);
  }
}

}  // namespace parallax::core
