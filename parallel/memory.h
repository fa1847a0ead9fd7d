// What one rank holds for training state (parameters, gradients, optimizer state), as the engines
// measure it (Engine::memory(), storage_bytes). The rules that predict it from a parameter list
// alone are in parallel/memory_rules.h.
//
// Thread-safety: pure functions. Errors: none beyond std::bad_alloc.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <vector>

namespace parallax::parallel {

// Bytes of the distinct storages of `tensors` (views of one buffer count once, whole).
int64_t storage_bytes(const std::vector<at::Tensor>& tensors);

// Bytes one rank holds for training state (docs/PERFORMANCE.md's memory table): parameters,
// gradients (after a backward: flat buckets, shards, accumulators; each storage counted once) and
// optimizer state (moments, fp32 masters; per-parameter step counters left out).
struct EngineMemory {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};

}  // namespace parallax::parallel
