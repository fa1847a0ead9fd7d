// The validated parallel plan of a run: what the `parallel` section (and the settings that
// interact with it) ask for, checked once against the world, with errors that name the keys and
// numbers. The trainer applies it in one place and in one fixed order (train/trainer.cpp,
// TrainerImpl::setup; step 4 through parallel::build_engine), as torchtitan's parallelize does:
//
//   1. tensor-parallel layers (built by the model factory): they change the shapes of the
//      parameters every later step sees, so they come first;
//   2. activation checkpointing, per model unit: it wraps the forward of whole units, which must
//      already hold their final (TP) layers, and must wrap them before any engine attaches hooks to
//      unit boundaries (ZeRO-3 gathers, pipeline cuts) so those hooks see the recomputation;
//   3. pipeline stages: they decide which units (and so which parameters) live on this rank,
//      which the data-parallel engine must know before it buckets or shards anything;
//   4. DDP or ZeRO over the data-parallel group: last, on exactly the parameters this rank owns,
//      in their final shapes.
//
// Pure data and validation: no communicator, no model.
#pragma once

#include "parallel/comm/topology.h"
#include "parallel/parallel_config.h"

#include <string>
#include <vector>

namespace parallax::parallel {

// The model transforms a run applies before the plan (train/lora.h, train/qat.h,
// train/distill.h): which layouts each runs under is part of the plan's validation.
struct PlanTransforms {
  bool lora = false;     // lora.rank > 0
  bool qat = false;      // qat.enabled
  bool distill = false;  // distill.teacher set
};

struct Plan {
  comm::Layout layout;
  int zero_stage = 0;                             // 0: DDP (or one process)
  bool sequence_parallel = false;                 // tp > 1 only
  bool zero_prefetch = true;                      // ZeRO-3: gather the next unit ahead
  std::string activation_checkpointing = "none";  // none | selective | full
  bool cuda_graph = false;
  std::string pp_schedule = "1f1b";  // pp > 1
  int pp_virtual_stages = 1;
  std::vector<int> pp_layout;

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

  // "dp=2 x tp=1 x pp=1, ZeRO-1, activation checkpointing selective".
  std::string describe() const;
  // The engine's name: "single process", "DDP", "ZeRO-1", ...
  std::string engine_name() const;
};

}  // namespace parallax::parallel
