// `parallax plan`: which parallel layout to run a config on N GPUs of M GiB, and why
// (docs/planning.md). For every layout (dp x tp x pp, ZeRO stage, sequence parallelism,
// micro-batch size and count, pipeline schedule, activation checkpointing) the planner predicts the
// memory of every rank and the step time, from the model itself:
//
//   - parameters, gradients and optimizer state: the model is built (on the CPU, at the layout's
//     tp through a shape-only group, so every shard has its real shape); the pipeline partition
//     (parallel/pipeline partition) picks each rank's units and the trainer's parameter groups
//     are formed, then each engine's own memory rule (parallel::predicted_memory,
//     parallel/memory_rules.h: the rules beside the DDP and ZeRO engines, with ZeRO's bucket keys,
//     DDP's bucket assignment, padding and shard ranges) gives the bytes. These are exact: a test
//     checks them against Engine::memory() of real runs, rank by rank.
//   - activations: the model's per-unit activation model (Model::unit_activations) times the
//     micro-batch, times the micro-batches each schedule keeps in flight on each rank (counted on
//     the schedule's own plan), with checkpointed blocks keeping only their inputs.
//   - step time: the units' FLOPs over a compute efficiency, the collectives' bytes over the
//     bandwidth of their group (inside a node or across nodes), overlapped as each engine
//     overlaps, and the pipeline schedule simulated with the stages' costs.
//
// Thread-safety: none needed (single-threaded tool). Errors: ConfigError for a config the planner
// cannot model (LoRA, QAT, distillation), naming the key.
#pragma once

#include "train/planner_types.h"
#include "train/run_config.h"

#include <algorithm>
#include <string>
#include <vector>

namespace parallax::train::planner {

// Every layout, ranked: those that fit first, by predicted throughput; then the rejected ones
// with their reason.
std::vector<Row> plan(const RunConfig& cfg, const Request& req);

// The prediction for one layout (the trainer's, from cfg's parallel/train/data keys) on `hw`.
Row predict(const RunConfig& cfg, const Candidate& layout, const Hardware& hw);

// The config's own layout for `world` ranks.
Candidate configured_layout(const RunConfig& cfg, int world);

// Exact Engine::memory() of every world rank of cfg's layout on `world` ranks (`cuda`: NCCL
// ranks, whose DDP buckets are grouped; CPU ranks use flat buckets).
std::vector<parallel::EngineMemory> engine_memory(const RunConfig& cfg, int world, bool cuda);

// Activation bytes one micro-batch of `micro_batch` samples keeps through the whole model (one
// process or one tp group; pp = 1, no checkpointing), as the planner counts them.
double activation_bytes(const RunConfig& cfg, int tp, bool sequence_parallel, int64_t micro_batch,
                        bool cuda);

// The ranked table (fitting layouts first; at most `max_rows` of them, every one when
// max_rows <= 0) and the JSON document (one object per row).
std::string render_table(const std::vector<Row>& rows, const Hardware& hw, int max_rows);
std::string render_json(const std::vector<Row>& rows, const Hardware& hw);

}  // namespace parallax::train::planner
