// Plan step 4 (parallel/parallelize.h): the engine a validated plan asks for, ZeRO stage 0 (DDP, or
// the plain step with one data-parallel rank) or ZeRO-1/2/3, over the data-parallel group. What
// each of them will hold is predicted without building it by parallel/memory_rules.h.
#pragma once

#include "parallel/ddp/ddp.h"
#include "parallel/engine.h"
#include "parallel/plan.h"
#include "units/param_init.h"

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
                                     const ddp::DdpOptions& ddp,
                                     std::vector<units::Unit> units = {},
                                     TensorParallelInfo tp = {},
                                     std::shared_ptr<const units::DeferredInit> deferred = nullptr);

}  // namespace parallax::parallel
