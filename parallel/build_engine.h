// Plan step 4 (parallel/parallelize.h): the engine a validated plan asks for, ZeRO stage 0 (DDP, or
// the plain step with one data-parallel rank) or ZeRO-1/2/3, over the data-parallel group.
#pragma once

#include "core/param_init.h"
#include "parallel/ddp/ddp.h"
#include "parallel/engine.h"
#include "parallel/plan.h"

namespace parallax::parallel {

// `groups`: the optimizer's parameter groups over `module`'s trainable parameters (names as in
// named_parameters()); `make` builds the optimizer over the groups the engine hands it (the
// parameters, or this rank's pieces of them). `ddp`: bucket caps, modes and unused-parameter
// handling, shared by DDP and ZeRO's gradient buckets. `units`: the model's ordered units
// (Model::units()), which ZeRO-3 gathers and frees one by one (install the engine's unit_hooks()
// in the model); the other engines ignore them. `tp`: the model's tensor parallelism (its layers
// already split by the model factory, plan step 1). `deferred`: the recipes of a model whose
// parameters are placeholders (ZeRO-3 only: parallel/zero/zero.h).
std::unique_ptr<Engine> build_engine(const Plan& plan, std::shared_ptr<torch::nn::Module> module,
                                     std::vector<optim::ParamGroup> groups,
                                     const OptimizerFactory& make, comm::CommPtr dp,
                                     const ddp::DdpOptions& ddp, std::vector<core::Unit> units = {},
                                     TensorParallelInfo tp = {},
                                     std::shared_ptr<const core::DeferredInit> deferred = nullptr);

// The memory the engine build_engine() builds for `zero_stage` holds on data-parallel rank
// q.dp_rank for fp32 `params` (this rank's, in registration order; under a pipeline its stage's):
// the rule each engine states (DdpEngine::memory_rule, ZeroEngine::memory_rule), equal to what
// Engine::memory() measures after a step. `parallax plan` predicts with it.
EngineMemory predicted_memory(int zero_stage, const std::vector<ParamInfo>& params,
                              const MemoryQuery& q);

}  // namespace parallax::parallel
