// build_run()'s model step (train/run_steps.h): the model built for the run's purpose, with its
// weights, the extension's transform, FP8 and the frozen model.
#include "checkpoint/finite.h"
#include "checkpoint/format.h"
#include "checkpoint/weights.h"
#include "comm/agree.h"
#include "comm/shape_only_group.h"
#include "comm/topology.h"
#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "kernels/fp8.h"
#include "models/model.h"
#include "models/vit.h"
#include "parallel/parallelize.h"
#include "parallel/tensor/tensor_parallel.h"
#include "train/extension.h"
#include "train/pretrained.h"
#include "train/run_steps.h"
#include "units/param_init.h"

#include <fmt/format.h>

namespace parallax::train::detail {

namespace ck = checkpoint;
namespace tensor = parallel::tensor;

namespace {

// Each rank reads only its slices of tensor-parallel tensors (HDF5 hyperslabs of a weights file or
// a checkpoint's boxes; the others whole): no rank holds the whole model.
void read_tp_slices(const Run& run, ck::WeightsOptions& w) {
  if (!run.tp) return;
  auto layouts = std::make_shared<const std::map<std::string, tensor::ParamLayout>>(
      tensor::param_layouts(*run.model));
  w.boxes_of = [layouts](const std::string& name,
                         const at::Tensor& local) -> std::optional<ck::TensorBoxes> {
    const auto it = layouts->find(name);
    if (it == layouts->end()) return std::nullopt;
    ck::TensorBoxes b;
    b.shape = tensor::global_shape(local.sizes().vec(), it->second);
    for (auto& box : tensor::split_boxes(local, it->second))
      b.boxes.emplace_back(box.local, std::move(box.offsets));
    return b;
  };
}

// Where a model built without storage reads its tensors (empty: its initialisation recipes).
struct Sources {
  bool defer = false;            // built without storage (parallel.meta_init)
  bool load_pretrained = false;  // train.load_from goes into the model
  std::string deferred;          // what the recipes read from
};

Sources weight_sources(const Run& run) {
  const RunConfig& cfg = run.cfg;
  const bool sharded_model = run.plan.shards_model();
  Sources s;
  // ZeRO-3 over several ranks, or pipeline stages, build the model without storage; each rank then
  // materialises only what it owns, its ZeRO-3 shard or its stages (parallel.meta_init;
  // units/param_init.h, parallel/parallelize.h): with the values a full build gives, or read one
  // tensor at a time from train.load_from's weights, or (a resumed pipeline run) from the
  // checkpoint. A model transform that cannot work on recipes (QAT's weight ranges) needs the
  // full build; LoRA's adapters become recipes too (TrainerHooks::transform_defers).
  s.defer = cfg.parallel.meta_init && (sharded_model || run.plan.layout.pp > 1) &&
            (!run.hooks.transform_model || run.hooks.transform_defers);
  // Pretrained weights (not when resuming: the checkpoint holds the trained model) and the
  // resumed model go into the model as built (deferred: into its recipes).
  s.load_pretrained = (!run.resume || run.hooks.saves_model_tensor) && !cfg.train.load_from.empty();
  s.deferred = !s.defer                       ? std::string()
               : s.load_pretrained            ? cfg.train.load_from
               : run.resume && !sharded_model ? run.resume->dir()
                                              : std::string();
  return s;
}

std::string load_context(const Run& run) {
  return fmt::format("train.load_from '{}'", run.cfg.train.load_from);
}
constexpr const char* kLoadAdvice = "point train.load_from at an earlier checkpoint";

// The deferred model's recipes read from `s.deferred` (checked, names and shapes, on every rank
// before any engine exists: a rank that fails alone must not leave the others in the engine's
// first collective).
void defer_reads(Run& run, const Sources& s, units::DeferredInit& recipes) {
  ck::WeightsOptions w;
  w.strict = run.cfg.train.strict_load;
  if (s.load_pretrained) w = pretrained_load_options(run.cfg, *run.model, s.deferred);
  read_tp_slices(run, w);
  const std::string context = load_context(run);
  comm::agree_on(
      *run.world_comm, run.device,
      s.load_pretrained ? context : fmt::format("resume from '{}': loading the model", s.deferred),
      [&]() -> int64_t {
        ck::DeferredWeights dw = ck::defer_weights(*run.model, s.deferred, w);
        if (s.load_pretrained) {
          core::log::info("train.load_from={} ({}; each rank reads what it owns):\n{}", s.deferred,
                          dw.report.format, dw.report.table());
          run.load_report = dw.report.json();
        }
        // Pretrained weights are checked for NaN as each tensor is read (the checkpoint of a
        // resume: after the engine, by load_resumed_state).
        for (auto& [name, read] : dw.readers) {
          if (!s.load_pretrained) {
            recipes.replace(name, read);
            continue;
          }
          recipes.replace(name, [read, name = name, context]() {
            at::Tensor v = read();
            ck::require_finite({{name, v}}, context, kLoadAdvice);
            return v;
          });
        }
        return 0;
      });
}

// A resumed ZeRO-3 run reads each rank's shard from the checkpoint after the engine has sharded
// the model, overwriting every parameter the checkpoint holds: those start as zeros rather than
// as their initialisation's draws, which cost as much as the model's size in random numbers on
// every rank for nothing. Buffers keep their values: they are small, and the assembly reads some
// before the resume (mlp's teacher makes the synthetic data).
void skip_resumed_initialisation(Run& run, units::DeferredInit& recipes) {
  const auto& saved = run.resume->metadata().tensors;
  std::size_t skipped = 0;
  for (const auto& item : run.model->named_parameters()) {
    if (!saved.count(ck::kModelPrefix + item.key())) continue;
    recipes.replace(item.key(), [shape = item.value().sizes().vec()] { return at::zeros(shape); });
    ++skipped;
  }
  core::log::info(
      "resume: {} of {} model tensors skip their initialisation (the checkpoint overwrites them)",
      skipped, recipes.size());
}

// The model built without storage, its recipes reading what they should, the transform on them,
// then placed: each rank materialises what it owns.
std::shared_ptr<units::DeferredInit> build_deferred(Run& run, const Sources& s) {
  std::shared_ptr<units::DeferredInit> recipes;
  {
    units::DeferredInitScope deferred;
    run.model = run.tp ? models::build_model(run.cfg.model, run.scene, run.tp)
                       : models::build_model(run.cfg.model, run.scene);
    recipes = deferred.recipes();
  }
  if (!s.deferred.empty()) defer_reads(run, s, *recipes);
  if (run.resume && run.plan.shards_model() && s.deferred.empty())
    skip_resumed_initialisation(run, *recipes);
  if (run.hooks.transform_model) {
    // The transform on the recipes (its tensors recorded as recipes and named like the model's).
    {
      units::DeferredInitScope more(recipes);
      run.hooks.transform_model(*run.model);
    }
    recipes->bind(*run.model);
  }
  units::place_deferred(*run.model, *recipes, run.device);
  core::log::info(
      "model built without storage (parallel.meta_init): {} tensors, each rank materialises its "
      "{}{}",
      recipes->size(), run.plan.shards_model() ? "ZeRO-3 shard" : "pipeline stages",
      s.deferred.empty() ? "" : fmt::format(" from '{}'", s.deferred));
  return recipes;
}

// The model built whole on every rank: train.load_from's weights, then the transform.
void build_full(Run& run, const Sources& s) {
  run.model = run.tp ? models::build_model(run.cfg.model, run.scene, run.tp)
                     : models::build_model(run.cfg.model, run.scene);
  run.model->to(run.device);
  // Pretrained weights go into the model as built; the transform (e.g. LoRA adapters, QAT
  // observers) comes after them, and a resumed checkpoint, saved from the transformed model, is
  // loaded after the transform. A checkpoint that holds only some model tensors
  // (TrainerHooks::saves_model_tensor, e.g. LoRA's adapters) needs these weights on resume too.
  if (s.load_pretrained) {
    ck::WeightsOptions w = pretrained_load_options(run.cfg, *run.model, run.cfg.train.load_from);
    read_tp_slices(run, w);
    // A rank that fails alone (a NaN only in its slice) must not leave the others waiting in the
    // engine's first collective.
    comm::agree_on(*run.world_comm, run.device, load_context(run), [&]() -> int64_t {
      const auto report = ck::load_weights(*run.model, run.cfg.train.load_from, w);
      core::log::info("train.load_from={} ({}):\n{}", run.cfg.train.load_from, report.format,
                      report.table());
      run.load_report = report.json();
      if (!run.hooks.checks_loaded_weights)
        ck::require_finite(*run.model, load_context(run), kLoadAdvice);
      return 0;
    });
  }
  if (run.hooks.transform_model) {
    run.hooks.transform_model(*run.model);
    run.model->to(run.device);  // parameters the transform added
  }
}

// The resumed model before the engine (ZeRO-3 over several ranks reads its shards after it, and a
// deferred pipeline model read them into its recipes).
void load_resumed_model(Run& run, const Sources& s) {
  if (!run.resume || run.plan.shards_model() || s.deferred == run.resume->dir()) return;
  // Each rank reads its part (tensor or pipeline parallelism: its slices); a rank that fails alone
  // must not leave the others in the engine's first collective (agree_on).
  comm::agree_on(*run.world_comm, run.device,
                 fmt::format("resume from '{}': loading the model", run.resume->dir()),
                 [&]() -> int64_t {
                   with_config_hint(run, {"model.", "lora.", "qat."}, [&] {
                     if (run.hooks.saves_model_tensor || run.tp) {
                       load_model_pieces(run);
                     } else {
                       ck::load_weights(*run.resume, *run.model);
                     }
                   });
                   return 0;
                 });
}

void build_frozen_model(Run& run) {
  if (!run.hooks.frozen_model) return;
  run.frozen = run.hooks.frozen_model(run.cfg, run.scene, run.device);
  PARALLAX_CHECK(run.frozen != nullptr, Error, "TrainerHooks::frozen_model returned no model");
  run.frozen->to(run.device);
  run.frozen->eval();
  for (auto& p : run.frozen->parameters()) p.set_requires_grad(false);
}

}  // namespace

void apply_fp8(Run& run) {
  const int n = models::enable_fp8(*run.model, run.precision.fp8_options());
  PARALLAX_CHECK(n > 0, ConfigError,
                 "key 'precision.mode': fp8 computes the ViT blocks' linear layers in FP8, and "
                 "model '{}'{} has none; use precision.mode=bf16",
                 run.cfg.model.name, run.cfg.model.name == "bev" ? " with this backbone" : "");
  if (run.purpose == Purpose::kPlan) return;  // shape-only: what is converted, not its state
  std::vector<kernels::fp8::Fp8LinearImpl*> layers = kernels::fp8::fp8_layers(*run.model);
  for (auto* l : layers) l->to(run.device);
  // The MAX all-reduce of the delayed recipe's amaxes over the replicas of this rank's layers
  // (dp, then tp).
  std::vector<comm::CommPtr> groups;
  for (const char* g : {"dp", "tp"}) {
    const comm::CommPtr c = run.topo ? run.topo->group(g) : nullptr;
    if (c && c->size() > 1) groups.push_back(c);
  }
  kernels::fp8::AmaxReducer reduce;
  if (!groups.empty()) {
    reduce = [groups](at::Tensor& amax) {
      for (const auto& c : groups) c->all_reduce_async(amax, comm::ReduceOp::kMax)->wait_stream();
    };
  }
  run.precision.attach_fp8(std::move(layers), std::move(reduce));
  if (run.purpose != Purpose::kTrain) return;
  const auto& o = run.precision.fp8_options();
  core::log::info(
      "precision fp8: {} linear layers (the ViT blocks' qkv, proj, fc1, fc2) on FP8 tensor cores, "
      "E4M3 forward and E5M2 gradients, {} scaling{}",
      n, o.recipe == kernels::fp8::Recipe::kDelayed ? "delayed" : "current",
      o.recipe == kernels::fp8::Recipe::kDelayed
          ? fmt::format(" over {} steps of amax history", o.amax_history)
          : "");
}

std::shared_ptr<units::DeferredInit> build_training_model(Run& run) {
  // Identical initialisation on every rank (DDP also broadcasts from rank 0).
  core::seed_all(static_cast<uint64_t>(run.cfg.experiment.seed));
  // The model's tensor-parallel layers are built by the factory over the plan's group (plan step
  // 1, parallel/parallelize.h).
  run.tp = parallel::tensor_parallel_group(run.plan, *run.topo);
  const Sources s = weight_sources(run);
  std::shared_ptr<units::DeferredInit> recipes;
  if (s.defer) {
    recipes = build_deferred(run, s);
  } else {
    build_full(run, s);
  }
  run.model->train();
  // After the pretrained weights (which hold no scaling state), before the resume (which does).
  if (run.precision.fp8()) apply_fp8(run);
  // A deferred pipeline model read the checkpoint into its recipes, before the FP8 layers and
  // their histories existed: they are read here, so that the resume stays bitwise.
  if (run.resume && s.defer && s.deferred == run.resume->dir() &&
      !run.precision.fp8_layers().empty()) {
    comm::agree_on(
        *run.world_comm, run.device,
        fmt::format("resume from '{}': loading the FP8 amax histories", run.resume->dir()),
        [&]() -> int64_t {
          load_fp8_histories(run);
          return 0;
        });
  }
  load_resumed_model(run, s);
  build_frozen_model(run);
  core::log::info("model {}/{}: {:.3f} M parameters, {:.3f} GFLOP forward per sample",
                  run.cfg.model.name, run.cfg.model.size, run.model->parameter_count() / 1e6,
                  run.model->forward_flops_per_sample() / 1e9);
  if (run.graph) {
    const std::string blocker = run.model->graph_capture_blocker();
    PARALLAX_CHECK(
        blocker.empty(), ConfigError,
        "key 'train.cuda_graph': model '{}' cannot be captured: {}; set train.cuda_graph=false",
        run.cfg.model.name, blocker);
    core::log::info(
        "CUDA graph: {} eager warm-up step(s), then the whole step is captured and replayed",
        run.cfg.train.cuda_graph_warmup);
  }
  return recipes;
}

void restore_model(Run& run, const std::string& source) {
  if (run.purpose == Purpose::kEval) core::seed_all(static_cast<uint64_t>(run.cfg.experiment.seed));
  if (run.extension) run.model = run.extension->restore(run.cfg, run.scene, source, run.loaded);
  if (!run.model) {
    run.model = models::build_model(run.cfg.model, run.scene);
    run.loaded = ck::load_weights(*run.model, source).summary();
  }
  if (run.purpose != Purpose::kEval) return;
  // Weights holding NaN or inf (a diverged run's, or a hand-made file) would score a NaN loss and
  // zero metrics with rc 0: refused, as export and inspect refuse them.
  ck::require_finite(*run.model, fmt::format("eval: checkpoint '{}'", source),
                     "refusing to evaluate non-finite weights; evaluate an earlier checkpoint");
  if (run.precision.fp8()) apply_fp8(run);  // the FP8 layers the trainer's evaluation runs
  run.model->to(run.device);
}

void build_shape_model(Run& run, int tp, bool sequence_parallel) {
  at::NoGradGuard no_grad;
  // Shapes, names, units and layouts only: no parameter is materialised (units/param_init.h).
  units::ShapeOnlyScope shape_only;
  if (tp > 1) {
    run.tp = std::make_shared<tensor::TpGroup>(std::make_shared<comm::ShapeOnlyGroup>(tp, 0),
                                               sequence_parallel && tp > 1);
    run.model = models::build_model(run.cfg.model, run.scene, run.tp);
  } else {
    run.model = models::build_model(run.cfg.model, run.scene);
  }
  if (run.extension) run.extension->transform_shape_only(*run.model, run.cfg, tp);
  // FP8: the layers the trainer converts (the same refusals), whose inputs and weights are saved
  // as FP8 copies (models::ActivationQuery::fp8).
  if (run.precision.fp8()) apply_fp8(run);
  // The rules' frozen parameters carry no gradient and no optimizer state: the planner reads
  // requires_grad (planner_inventory.h).
  apply_param_groups(run, /*log=*/false);
}

}  // namespace parallax::train::detail
