// The memory rules of the data-parallel engines: what one rank holds for training state
// predicted from a parameter list alone (ddp_memory_rule, zero_memory_rule, predicted_memory).
// The rules live here, beside the engines whose layouts they restate (parallel/ddp/ddp_engine.h,
// parallel/zero/zero.h: the same bucket assignment, keys, padding and shard ranges), so that
// `parallax plan` (train/planner.h) predicts with the engines' own arithmetic and never builds
// one. A test checks each rule against Engine::memory() after a real step (tests/parallel/
// zero_test.cpp; rank by rank in tests/train/test_planner.py).
//
// Thread-safety: pure functions. Errors: none beyond std::bad_alloc.
#pragma once

#include "parallel/ddp/ddp_options.h"
#include "parallel/memory.h"

#include <cstdint>
#include <string>
#include <vector>

namespace parallax::parallel {

// A parameter as an engine's memory rule sees it (Engine::memory() measures; the rules below
// predict): `parallax plan` describes a shape-only model so and calls the engine's own rule.
struct ParamInfo {
  std::string name;
  int64_t numel = 0;
  int unit = 0;   // index into the model's units
  int group = 0;  // the optimizer's parameter group (optim::make_param_groups order)
  bool tp_sharded = false;
  bool trainable = true;  // false: frozen (a LoRA base weight)
};
// What else the rules need: the data-parallel group, the step's micro-batches, the model's
// units and the optimizer's groups and state, and the bucket options.
struct MemoryQuery {
  int dp = 1, dp_rank = 0;
  int micro_batches = 1;
  int units = 1;
  int groups = 1;                          // non-empty optimizer parameter groups
  double optimizer_bytes_per_element = 0;  // AdamW 8 (two fp32 moments), SGD with momentum 4
  ddp::DdpOptions ddp;
};

// What DdpEngine::memory() measures after a step, predicted for fp32 `params`: every parameter
// whole, a gradient per trainable one (autograd's, or DDP's flat buckets, which hold exactly the
// parameters), the optimizer state per trainable element.
EngineMemory ddp_memory_rule(const std::vector<ParamInfo>& params, const MemoryQuery& q);

// What ZeroEngine::memory() measures after a step at ZeRO `stage` (1, 2 or 3), predicted for fp32
// `params` (this rank's, registration order): the buckets the engine would build and this rank's
// shard of each (parameters, gradients, optimizer state), frozen parameters whole (stage 3 over
// several ranks: 1/N of each unit's).
EngineMemory zero_memory_rule(int stage, const std::vector<ParamInfo>& params,
                              const MemoryQuery& q);

// The memory the engine parallel::build_engine() builds for `zero_stage` (0: DDP) holds on
// data-parallel rank q.dp_rank for fp32 `params` (this rank's, in registration order; under a
// pipeline its stage's): the rule above for that engine, equal to what Engine::memory() measures
// after a step. `parallax plan` predicts with it.
EngineMemory predicted_memory(int zero_stage, const std::vector<ParamInfo>& params,
                              const MemoryQuery& q);

}  // namespace parallax::parallel
