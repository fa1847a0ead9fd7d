// Internal to the planner (train/planner.h is the API): the prediction of one candidate layout,
// in two concerns. planner_memory.cpp: the pipeline stages a candidate gives each rank and what
// each rank holds (the engines' own memory rules, parallel/memory_rules.h, and the activation
// model). planner_predict.cpp: the step time, and predict_with(), which puts memory and time
// together into a Row. planner.cpp enumerates the candidates and calls predict_with() on each.
#pragma once

#include "train/planner_inventory.h"

#include "parallel/memory_rules.h"

#include <memory>
#include <string>
#include <vector>

namespace parallax::train::planner::detail {

// The pipeline stages of `b` for a candidate: stage s holds units [bounds[s], bounds[s + 1]),
// which pipeline rank and stage each unit is on, and the schedule (pp > 1).
struct Stages {
  std::vector<int> bounds;
  std::shared_ptr<const BuiltSchedule> built;
  std::vector<int> rank_of_unit;
  std::vector<int> stage_of_unit;
  const parallel::pipeline::Schedule& schedule() const { return built->schedule; }
};

// What the model's activation model is asked for a candidate (compute dtype, FP8, tp, SP).
models::ActivationQuery query(const RunConfig& cfg, const Candidate& l, bool cuda);

// The trainer's partition of `b` for `l` (ConfigError, naming the keys, for more stages than
// units or a schedule beyond kMaxPipelineSlots).
Stages make_stages(const Built& b, const Candidate& l, const RunConfig& cfg, bool cuda,
                   ScheduleCache& cache);

// Exact engine memory of the rank at (dp_rank, pp_rank) (every tp rank of an even split holds the
// same shapes): the engine's own rule (parallel::predicted_memory) on this rank's parameters.
parallel::EngineMemory engine_bytes(const Built& b, const Stages& st, const Candidate& l,
                                    int dp_rank, int pp_rank, const RunConfig& cfg);

// The activation model of `b` under `l` on pipeline rank `pp_rank`: the peak of saved bytes over
// the schedule, and the largest transient.
struct Activations {
  double peak = 0, transient = 0, boundary = 0;  // boundary: a pipeline message, bytes
  double recompute_fraction = 0;                 // forward FLOPs recomputed / forward FLOPs
};
Activations activations(const Built& b, const Stages& st, const Candidate& l, int pp_rank,
                        const RunConfig& cfg, bool cuda);

// The parameter elements on one pipeline rank, which the step time's collectives move.
struct StageElems {
  double params = 0, trainable = 0;
};
// Everything pipeline rank `pp_rank` (its dp rank 0, which holds the largest ZeRO piece) holds at
// the allocator's peak; `elems`: the rank's parameter elements.
RankMemory rank_memory(const Built& b, const Stages& st, const Candidate& l, int pp_rank,
                       const RunConfig& cfg, const Hardware& hw, StageElems& elems);

// The prediction of `l` on `hw`: why it cannot run (the trainer's own validation, the model, the
// partition), else every pipeline rank's memory, the step time and whether it fits.
Row predict_with(Inventory& inv, const RunConfig& cfg, const Candidate& l, const Hardware& hw);

}  // namespace parallax::train::planner::detail
