// parallelize(): a validated plan (parallel/plan.h) applied to a model, in one place and in one
// fixed order, as torchtitan's parallelize_* functions do. The trainer builds the model (through
// the tensor-parallel factory), loads its weights and applies its model transforms (LoRA, QAT),
// then hands the model and the plan here and gets the engine it trains through:
//
//   1. tensor parallelism. The model factory has already built the column- and row-parallel
//      layers over tensor_parallel_group(plan): they change the shapes of the parameters that
//      every later step sees, so they come first. Here: the sequence-parallel gradient hooks (the
//      LayerNorm and row-bias gradients summed over tp as autograd makes them, before any engine's
//      hook sees them), and each split parameter's layout for the engines' checkpoint pieces.
//   2. activation checkpointing, per model unit. It wraps the forward of whole blocks, which must
//      already hold their final (TP) layers, and it must wrap them before any engine attaches
//      hooks to unit boundaries (ZeRO-3 gathers, pipeline cuts), so those hooks see the
//      recomputation.
//   3. pipeline stages. They decide which units, and so which parameters, live on this rank,
//      which the data-parallel engine must know before it buckets or shards anything. Balanced by
//      the model's stage costs, then by the activation bytes as this run keeps them (precision,
//      device, tp, checkpointing: step 2's choice), which `parallax plan` predicts from the same
//      functions.
//   4. DDP or ZeRO-1/2/3 over the data-parallel group (parallel/build_engine.h): last, on exactly
//      the parameters this rank owns, in their final shapes, with the optimizer over them. Under a
//      pipeline it is the stage's inner engine. Then the engine's unit hooks (ZeRO-3 gathers and
//      frees per unit) go into the model.
//
// Thread-safety: one training thread. Errors: ConfigError naming the key and the model (a model
// that cannot be pipelined; partition errors name parallel.pp_layout), CommError/TimeoutError from
// the engines' first collectives (DDP and ZeRO broadcast the parameters from dp rank 0).
#pragma once

#include "optim/optimizer.h"
#include "parallel/engine.h"
#include "parallel/plan.h"
#include "parallel/tensor/tensor_parallel.h"
#include "units/parallel_model.h"
#include "units/param_init.h"

#include <memory>
#include <string>
#include <vector>

namespace parallax::parallel {

// The tensor-parallel group to build the plan's model over (models::build_model(cfg, scene, tp):
// step 1); null without tensor parallelism.
tensor::TpPtr tensor_parallel_group(const Plan& plan, const comm::Topology& topo);

// What a checkpoint holds of `module` as built for `plan` over `tp` (its tensors whole; under
// tensor parallelism each split tensor as the boxes of the whole tensor this rank holds), in the
// single-process names and shapes: the model's pieces before parallelize() has built the engine
// (Engine::checkpoint_model afterwards). Views of live state: load into them.
std::vector<StatePiece> checkpoint_module(const torch::nn::Module& module, const Plan& plan,
                                          const tensor::TpPtr& tp);

struct ParallelizeOptions {
  std::string model_name;  // in errors ("model 'mlp' does not expose ...")
  int micro_batches = 1;   // per optimizer step (train.grad_accum): the pipeline's schedule
  // The optimizer over the trainable parameters as they are after step 3: its groups as
  // optim::make_param_groups decides them from optimizer.weight_decay, .param_groups and
  // .layer_decay (optim/param_groups.h). The trainer has applied the rules' `frozen` already.
  optim::OptimConfig optimizer;
  // Each parameter's layer (the model's Model::layer_depth), for optimizer.layer_decay != 1.
  optim::LayerOf layer_of;
  // Of the activation query (units::ActivationQuery) that balances pipeline stages: the bytes of
  // the compute dtype (2 under bf16/fp16 autocast) and whether the model runs on a GPU.
  int compute_bytes = 4;
  bool cuda = false;
  // The model's recipes when it was built under units::DeferredInitScope and its parameters are
  // placeholders (units::place_deferred): the plan must shard the model (Plan::shards_model()) or
  // split it into pipeline stages. ZeRO-3 then materialises only each rank's shard
  // (parallel/zero/zero.h); under a pipeline, the data-parallel engine's parameters (this rank's
  // stages') get their values before it is built, the other stages' are never materialised.
  // Tensor-parallel layers record this rank's slices. Null: the model holds its values.
  std::shared_ptr<const units::DeferredInit> deferred;
};

// Applies steps 1-4 to `model` (built over tensor_parallel_group(plan, topo), on its device) and
// returns the engine. Collective over the world: every rank calls it at the same point.
std::unique_ptr<Engine> parallelize(units::ParallelModel& model, const Plan& plan,
                                    const comm::Topology& topo, const tensor::TpPtr& tp,
                                    const ParallelizeOptions& options);

}  // namespace parallax::parallel
