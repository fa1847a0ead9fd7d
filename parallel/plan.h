// The validated parallel plan of a run: what the `parallel` section (and the settings that
// interact with it) ask for, checked once against the world, with errors that name the keys and
// numbers, before anything is built. parallel::parallelize() (parallel/parallelize.h) applies it
// to a model in one place and in one fixed order, with the reasons for that order.
//
// Pure data and validation: no communicator, no model.
#pragma once

#include "comm/topology.h"
#include "parallel/ddp/ddp_options.h"
#include "parallel/parallel_config.h"
#include "parallel/pipeline/schedule.h"
#include "units/parallel_model.h"

#include <string>
#include <vector>

namespace parallax::parallel {

// The model transforms a run applies before the plan (train/lora/lora.h, train/qat/qat.h,
// train/distill/distill.h): which layouts each runs under is part of the plan's validation.
struct PlanTransforms {
  bool lora = false;     // lora.rank > 0
  bool qat = false;      // qat.enabled
  bool distill = false;  // distill.teacher set
};

struct Plan {
  comm::RankLayout layout;
  int zero_stage = 0;              // 0: DDP (or one process)
  bool sequence_parallel = false;  // tp > 1 only
  bool zero_prefetch = true;       // ZeRO-3: gather the next unit ahead
  units::Recompute activation_checkpointing = units::Recompute::kNone;
  bool cuda_graph = false;
  pipeline::ScheduleKind pp_schedule = pipeline::ScheduleKind::k1F1B;  // pp > 1
  int pp_virtual_stages = 1;
  std::vector<int> pp_layout;
  // DDP's and ZeRO's gradient buckets (parallel.ddp.*, parallel.allreduce), parsed.
  ddp::DdpOptions ddp;

  using Transforms = PlanTransforms;

  // Validates `p` for a world of `world` ranks with `gpus_per_node` GPUs (0: CPU ranks). Throws
  // LayoutError / ConfigError naming the key: tp that does not divide the world, pp with ZeRO-3
  // or CUDA graphs, virtual stages without the interleaved schedule, sequence parallelism without
  // tp, tp or ZeRO with CUDA graphs, ZeRO with a reduced-precision gradient reduction; and of the
  // `transforms`: LoRA, QAT or distillation under pp, LoRA or QAT under tp, distillation under
  // ZeRO-3.
  static Plan from(const ParallelConfig& p, const std::string& activation_checkpointing,
                   bool cuda_graph, int world, int gpus_per_node,
                   const Transforms& transforms = {});

  // Whether the engine keeps only a shard of the model's parameters on each rank (ZeRO-3 over
  // several data-parallel ranks): a resumed model is then read after parallelize(), each rank its
  // shard, instead of whole before it.
  bool shards_model() const { return zero_stage == 3 && layout.dp > 1; }
  // "dp=2 x tp=1 x pp=1, ZeRO-1, activation checkpointing selective".
  std::string describe() const;
  // The engine's name: "single process", "DDP", "ZeRO-1", ...
  std::string engine_name() const;
};

}  // namespace parallax::parallel
