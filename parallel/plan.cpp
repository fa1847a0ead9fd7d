#include "parallel/plan.h"

#include "core/error.h"

#include <fmt/format.h>

#include <tuple>

namespace parallax::parallel {

Plan Plan::from(const ParallelConfig& p, const std::string& activation_checkpointing,
                bool cuda_graph, int world, int gpus_per_node, const Transforms& transforms) {
  Plan plan;
  plan.layout = comm::resolve_layout(world, p.dp, p.tp, p.pp, gpus_per_node);
  plan.zero_stage = p.zero.stage;
  plan.activation_checkpointing = units::parse_recompute(activation_checkpointing);
  plan.cuda_graph = cuda_graph;
  plan.pp_schedule = pipeline::parse_schedule_kind(p.pp_schedule);
  plan.pp_virtual_stages = p.pp_virtual_stages;
  plan.pp_layout = p.pp_layout;
  pipeline::check_virtual_stages(plan.pp_schedule, p.pp_virtual_stages);
  if (plan.layout.pp > 1) {
    PARALLAX_CHECK(p.zero.stage != 3, ConfigError,
                   "keys 'parallel.pp' and 'parallel.zero.stage': ZeRO-3 under pipeline "
                   "parallelism is not available in this version (each stage holds only its own "
                   "units already; ZeRO-3 would gather them per micro-batch); use "
                   "parallel.zero.stage=0, 1 or 2");
    PARALLAX_CHECK(!cuda_graph, ConfigError,
                   "keys 'parallel.pp' and 'train.cuda_graph': a pipeline step (point-to-point "
                   "messages whose order the schedule fixes on the host) cannot be captured into "
                   "a CUDA graph in this version; set train.cuda_graph=false");
    PARALLAX_CHECK(plan.pp_schedule != pipeline::ScheduleKind::kZb ||
                       plan.activation_checkpointing == units::Recompute::kNone,
                   ConfigError,
                   "keys 'parallel.pp_schedule' and 'train.activation_checkpointing': zb splits "
                   "each backward into an input pass and a weight pass, and a checkpointed block "
                   "recomputes its whole backward in the first; use another schedule or "
                   "activation_checkpointing=none");
  }
  // The model transforms (train/lora/lora.h, train/qat/qat.h, train/distill/distill.h) and the
  // layouts they run under.
  if (plan.layout.pp > 1) {
    for (const auto& [on, key, what] :
         {std::make_tuple(transforms.lora, "lora.rank", "LoRA"),
          std::make_tuple(transforms.qat, "qat.enabled", "QAT"),
          std::make_tuple(transforms.distill, "distill.teacher", "distillation")}) {
      PARALLAX_CHECK(!on, ConfigError,
                     "keys '{}' and 'parallel.pp': the {} trainer does not run under pipeline "
                     "parallelism in this version; use parallel.pp=1 (data, tensor parallel or "
                     "ZeRO)",
                     key, what);
    }
  }
  if (plan.layout.tp > 1) {
    PARALLAX_CHECK(!transforms.lora, ConfigError,
                   "keys 'lora.rank' and 'parallel.tp': LoRA adapts dense linear layers and "
                   "parallel.tp={} makes them column/row-parallel; use parallel.tp=1 (data "
                   "parallel or ZeRO) for LoRA in this version",
                   plan.layout.tp);
    PARALLAX_CHECK(!transforms.qat, ConfigError,
                   "keys 'qat.enabled' and 'parallel.tp': QAT quantizes dense linear layers and "
                   "parallel.tp={} makes them column/row-parallel; use parallel.tp=1 (data "
                   "parallel or ZeRO) for QAT in this version",
                   plan.layout.tp);
  }
  PARALLAX_CHECK(
      !transforms.distill || p.zero.stage < 3, ConfigError,
      "keys 'distill.teacher' and 'parallel.zero.stage': distillation runs under DDP and "
      "ZeRO-1/2 (the teacher replicated); ZeRO-3 is refused in this version (the feature "
      "projection runs outside the student's units, where ZeRO-3 keeps it sharded)");
  plan.sequence_parallel = p.sequence_parallel;
  PARALLAX_CHECK(!p.sequence_parallel || plan.layout.tp > 1, ConfigError,
                 "key 'parallel.sequence_parallel': it shards the tokens over the tensor-parallel "
                 "group; set parallel.tp > 1 or parallel.sequence_parallel=false");
  PARALLAX_CHECK(plan.layout.tp == 1 || !cuda_graph, ConfigError,
                 "keys 'parallel.tp' and 'train.cuda_graph': a tensor-parallel step cannot be "
                 "captured into a CUDA graph in this version; set train.cuda_graph=false");
  PARALLAX_CHECK(plan.zero_stage >= 0 && plan.zero_stage <= 3, ConfigError,
                 "key 'parallel.zero.stage': {} is not a ZeRO stage (0, 1, 2 or 3)",
                 plan.zero_stage);
  plan.zero_prefetch = p.zero.prefetch;
  if (plan.zero_stage > 0) {
    PARALLAX_CHECK(
        !cuda_graph, ConfigError,
        "keys 'parallel.zero.stage' and 'train.cuda_graph': a ZeRO-{} step cannot be captured into "
        "a "
        "CUDA graph in this version; set train.cuda_graph=false or parallel.zero.stage=0",
        plan.zero_stage);
    PARALLAX_CHECK(p.ddp.reduce_dtype == "grad", ConfigError,
                   "keys 'parallel.zero.stage' and 'parallel.ddp.reduce_dtype': ZeRO "
                   "reduce-scatters gradients in "
                   "their own dtype; set parallel.ddp.reduce_dtype=grad");
    PARALLAX_CHECK(p.allreduce == "native", ConfigError,
                   "keys 'parallel.zero.stage' and 'parallel.allreduce': ZeRO uses the backend's "
                   "reduce-scatter and "
                   "all-gather; set parallel.allreduce=native");
  }
  // DDP's buckets, shared by ZeRO's (parallel/ddp/ddp_options.h).
  plan.ddp.mode = ddp::parse_bucket_mode(p.ddp.bucket_mode);
  plan.ddp.reduce_dtype = ddp::parse_reduce_dtype(p.ddp.reduce_dtype);
  plan.ddp.bucket_mb = p.ddp.bucket_mb;
  plan.ddp.first_bucket_mb = p.ddp.first_bucket_mb;
  plan.ddp.find_unused = p.ddp.find_unused;
  plan.ddp.broadcast_buffers = p.ddp.broadcast_buffers;
  plan.ddp.algo = comm::parse_allreduce_algo(p.allreduce);
  // Backward timers: events recorded in a CUDA graph capture cannot be timed or queried.
  plan.ddp.timing = !cuda_graph;
  return plan;
}

std::string Plan::engine_name() const {
  if (zero_stage > 0) return fmt::format("ZeRO-{}", zero_stage);
  return layout.dp > 1 ? "DDP" : "single process";
}

std::string Plan::describe() const {
  return fmt::format(
      "{}, {}{}{}, activation checkpointing {}", layout.to_string(), engine_name(),
      layout.tp > 1
          ? (sequence_parallel ? ", tensor parallel + sequence parallel" : ", tensor parallel")
          : "",
      layout.pp > 1
          ? fmt::format(
                ", pipeline {}{}", pipeline::to_string(pp_schedule),
                pp_virtual_stages > 1 ? fmt::format(" x{} virtual stages", pp_virtual_stages) : "")
          : "",
      units::to_string(activation_checkpointing));
}

}  // namespace parallax::parallel
