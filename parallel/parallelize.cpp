#include "parallel/parallelize.h"

#include "core/error.h"
#include "core/log.h"
#include "optim/param_groups.h"
#include "parallel/build_engine.h"
#include "parallel/pipeline/pipeline_engine.h"
#include "parallel/state.h"

#include <ATen/ATen.h>

namespace parallax::parallel {

namespace {

TensorParallelInfo tensor_parallel_info(const torch::nn::Module& module, const tensor::TpPtr& tp,
                                        const comm::RankLayout& layout) {
  TensorParallelInfo info;
  if (!tp || layout.tp <= 1) return info;
  info.tp = tp->comm_ptr();
  info.layouts = tensor::param_layouts(module);
  info.layout = layout;
  return info;
}

}  // namespace

tensor::TpPtr tensor_parallel_group(const Plan& plan, const comm::Topology& topo) {
  if (plan.layout.tp <= 1) return nullptr;
  return std::make_shared<tensor::TpGroup>(topo.tp(), plan.sequence_parallel);
}

std::vector<StatePiece> checkpoint_module(const torch::nn::Module& module, const Plan& plan,
                                          const tensor::TpPtr& tp) {
  return global_pieces(module_pieces(module, {}), tensor_parallel_info(module, tp, plan.layout));
}

std::unique_ptr<Engine> parallelize(units::ParallelModel& model, const Plan& plan,
                                    const comm::Topology& topo, const tensor::TpPtr& tp,
                                    const ParallelizeOptions& options) {
  const std::shared_ptr<torch::nn::Module> module = model.as_module();
  const comm::RankLayout& layout = plan.layout;
  PARALLAX_CHECK(!options.deferred || plan.shards_model() || layout.pp > 1, Error,
                 "parallelize: a model built with deferred initialisation needs ZeRO-3 over "
                 "several data-parallel ranks or pipeline stages (plan: {})",
                 plan.describe());

  // 1. Tensor parallelism: the layers are the factory's; their gradients' sums over tp under
  // sequence parallelism, and the layouts the engines' checkpoint pieces are mapped through.
  PARALLAX_CHECK(layout.tp <= 1 || (tp && tp->size() == layout.tp), Error,
                 "parallelize: the plan has tp={} but the model was built over {}", layout.tp,
                 tp ? fmt::format("a tensor-parallel group of {}", tp->size())
                    : std::string("no tensor-parallel group"));
  tensor::install_sequence_parallel_hooks(tp);
  TensorParallelInfo tp_info = tensor_parallel_info(*module, tp, layout);

  // 2. Activation checkpointing, before any engine hooks unit boundaries.
  if (plan.activation_checkpointing != units::Recompute::kNone) {
    const auto [wrapped, blocks] = model.apply_recompute(plan.activation_checkpointing);
    core::log::info("activation checkpointing ({}): {} of {} blocks",
                    units::to_string(plan.activation_checkpointing), wrapped, blocks);
  }

  // 4 (built inside 3 under a pipeline): DDP or ZeRO over the trainable parameters as they are
  // then (under pipeline parallelism: this rank's stages').
  const optim::OptimConfig optim_cfg = options.optimizer;
  const optim::GroupSettings group_settings = optim::group_settings(
      optim_cfg.weight_decay, optim_cfg.param_groups, optim_cfg.layer_decay, options.layer_of);
  const auto data_parallel = [&]() -> std::unique_ptr<Engine> {
    // Deferred initialisation: ZeRO-3 materialises its shards itself; any other engine takes the
    // parameters as they are then (under a pipeline: this rank's stages', the others released),
    // so those get their values from the recipes now, one at a time.
    std::shared_ptr<const units::DeferredInit> deferred;
    if (options.deferred && plan.zero_stage == 3) {
      deferred = options.deferred;
    } else if (options.deferred) {
      at::NoGradGuard no_grad;
      for (auto& item : module->named_parameters()) {
        at::Tensor& p = item.value();
        if (p.numel() > 0) p.set_data(options.deferred->value(item.key()).to(p.options()));
      }
    }
    optim::NamedParams trainable;
    for (const auto& item : module->named_parameters())
      trainable.emplace_back(item.key(), item.value());
    return build_engine(
        plan, module, optim::make_param_groups(trainable, group_settings),
        [optim_cfg](std::vector<optim::ParamGroup> groups) {
          return optim::build_optimizer(optim_cfg, std::move(groups));
        },
        topo.dp(), plan.ddp, model.units(), std::move(tp_info), deferred);
  };

  std::unique_ptr<Engine> engine;
  if (layout.pp > 1) {
    // 3. This rank's stages of the model's chain of units; the other units' parameters are
    // released, and the data-parallel engine is built on the stage's parameters only.
    PARALLAX_CHECK(model.chain_length() > 0, ConfigError,
                   "key 'parallel.pp': model '{}' does not expose its forward as a chain of "
                   "units, so it cannot be split into pipeline stages",
                   options.model_name);
    const std::vector<units::Unit> units = model.units();
    PARALLAX_CHECK(static_cast<int>(units.size()) == model.chain_length(), Error,
                   "model '{}': {} units but a chain of {}", options.model_name, units.size(),
                   model.chain_length());
    pipeline::PipelineOptions po;
    po.schedule = plan.pp_schedule;
    po.virtual_stages = plan.pp_virtual_stages;
    po.layout = plan.pp_layout;
    units::ActivationQuery q;
    q.compute_bytes = options.compute_bytes;
    q.cuda = options.cuda;
    q.tp = layout.tp;
    q.sequence_parallel = plan.sequence_parallel && layout.tp > 1;
    po.activation_bytes = model.saved_activations(q, plan.activation_checkpointing, nullptr);
    engine = std::make_unique<pipeline::PipelineEngine>(
        module, units, model.stage_costs(), topo.pp(), options.micro_batches, po, data_parallel);
  } else {
    engine = data_parallel();
    engine->set_micro_batches(options.micro_batches);
  }
  // ZeRO-3 gathers and frees parameters around each unit of the model's forward.
  model.set_unit_hooks(engine->unit_hooks());
  core::log::info("parallel plan: {}; engine: {}", plan.describe(), engine->describe());
  return engine;
}

}  // namespace parallax::parallel
