// The planner's memory model: the pipeline stages a candidate gives each rank, the engines' own
// memory rules (parallel/memory_rules.h) on each rank's parameters, and the activation model
// (Model::unit_activations, Model::saved_activations) walked over the schedule
// (train/planner_predict.h).
#include "train/planner_predict.h"

namespace parallax::train::planner::detail {

namespace {

// The trainer's DdpOptions decisions that change memory.
struct BucketRules {
  bool flat = true;  // DDP buckets are flat (grads are views of them)
  int64_t first_cap = 0, cap = 0;
};

BucketRules bucket_rules(const RunConfig& cfg, bool cuda) {
  const auto& d = cfg.parallel.ddp;
  BucketRules r;
  const auto mode = parallel::ddp::parse_bucket_mode(d.bucket_mode);
  const bool native = cfg.parallel.allreduce == "native";
  const bool reduce_dtype = parallel::ddp::parse_reduce_dtype(d.reduce_dtype).has_value();
  if (mode == parallel::ddp::BucketMode::kAuto)
    r.flat = !(cuda && native && !reduce_dtype);
  else
    r.flat = mode == parallel::ddp::BucketMode::kFlat;
  r.first_cap = static_cast<int64_t>(d.first_bucket_mb * 1024.0 * 1024.0);
  r.cap = static_cast<int64_t>(d.bucket_mb * 1024.0 * 1024.0);
  return r;
}

double optimizer_bytes_per_element(const RunConfig& cfg) {
  if (cfg.optim.name == "adamw") return 8;  // exp_avg + exp_avg_sq, fp32 (parameters are fp32)
  return cfg.optim.momentum != 0 ? 4 : 0;   // sgd: the momentum buffer
}

}  // namespace

models::ActivationQuery query(const RunConfig& cfg, const Candidate& l, bool cuda) {
  models::ActivationQuery q;
  const optim::PrecisionPolicy precision = optim::PrecisionPolicy::from(cfg.precision, c10::kCPU);
  q.compute_bytes = precision.compute_bytes();
  q.fp8 = precision.fp8();
  q.cuda = cuda;
  q.tp = l.tp;
  q.sequence_parallel = l.sequence_parallel && l.tp > 1;
  return q;
}

Stages make_stages(const Built& b, const Candidate& l, const RunConfig& cfg, bool cuda,
                   ScheduleCache& cache) {
  Stages s;
  const int stages = l.pp * l.virtual_stages;
  if (l.pp == 1) {
    s.bounds = {0, static_cast<int>(b.units.size())};
  } else {
    const std::vector<double>& costs = b.pp_costs;
    // partition()'s own first check, made before the schedule is built: a schedule of pp 65536
    // took seconds to build for a model of 10 units (issue 35).
    PARALLAX_CHECK(static_cast<int>(costs.size()) >= stages, ConfigError,
                   "keys 'parallel.pp' and 'parallel.pp_virtual_stages': {} pipeline stages but "
                   "the model has only {} units to spread over them",
                   stages, costs.size());
    const int64_t slots = static_cast<int64_t>(stages) * l.micro_batches;
    PARALLAX_CHECK(slots <= kMaxPipelineSlots, ConfigError,
                   "keys 'train.grad_accum' and 'parallel.pp': {} micro-batches x {} pipeline "
                   "stages = {} slots, more than the {} a pipeline schedule is built and "
                   "simulated for; raise data.batch_size to use fewer, larger micro-batches",
                   l.micro_batches, stages, slots, kMaxPipelineSlots);
    s.built = cache.get(l);
    // The trainer's partition: costs, then activation bytes x in-flight micro-batches.
    s.bounds = parallel::pipeline::partition(
        costs, stages, cfg.parallel.pp_layout,
        b.model->saved_activations(query(cfg, l, cuda), units::parse_recompute(l.checkpointing)),
        s.built->in_flight);
  }
  s.rank_of_unit.assign(b.units.size(), 0);
  s.stage_of_unit.assign(b.units.size(), 0);
  for (int st = 0; st + 1 < static_cast<int>(s.bounds.size()); ++st) {
    for (int u = s.bounds[static_cast<std::size_t>(st)];
         u < s.bounds[static_cast<std::size_t>(st) + 1]; ++u) {
      s.stage_of_unit[static_cast<std::size_t>(u)] = st;
      s.rank_of_unit[static_cast<std::size_t>(u)] = l.pp == 1 ? 0 : st % l.pp;
    }
  }
  return s;
}

parallel::EngineMemory engine_bytes(const Built& b, const Stages& st, const Candidate& l,
                                    int dp_rank, int pp_rank, const RunConfig& cfg) {
  // This rank's parameters, registration order (the other stages' are released under pp).
  std::vector<const Param*> mine;
  for (const auto& p : b.params) {
    if (st.rank_of_unit[static_cast<std::size_t>(p.unit)] == pp_rank) mine.push_back(&p);
  }
  // The trainer's parameter groups (optim::make_param_groups): decay (dim > 1) first, then
  // no_decay, over the trainable parameters; empty ones dropped.
  bool any_decay = false, any_no_decay = false;
  for (const Param* p : mine) {
    if (!p->trainable) continue;
    (p->dim <= 1 ? any_no_decay : any_decay) = true;
  }
  std::vector<parallel::ParamInfo> params;
  for (const Param* p : mine) {
    parallel::ParamInfo info;
    info.name = p->name;
    info.numel = p->numel;
    info.unit = p->unit;
    info.group = p->dim <= 1 && any_decay ? 1 : 0;
    info.tp_sharded = l.tp > 1 && p->tp_sharded;
    info.trainable = p->trainable;
    params.push_back(std::move(info));
  }
  parallel::MemoryQuery q;
  q.dp = l.dp;
  q.dp_rank = dp_rank;
  q.micro_batches = l.micro_batches;
  q.units = static_cast<int>(b.units.size());
  q.groups = (any_decay ? 1 : 0) + (any_no_decay ? 1 : 0);
  q.optimizer_bytes_per_element = optimizer_bytes_per_element(cfg);
  q.ddp.first_bucket_mb = cfg.parallel.ddp.first_bucket_mb;
  q.ddp.bucket_mb = cfg.parallel.ddp.bucket_mb;
  return parallel::predicted_memory(l.zero, params, q);
}

Activations activations(const Built& b, const Stages& st, const Candidate& l, int pp_rank,
                        const RunConfig& cfg, bool cuda) {
  Activations a;
  const auto units = b.model->unit_activations(query(cfg, l, cuda));
  if (units.size() != b.units.size()) return a;
  const double mb = static_cast<double>(l.micro_batch);
  // Checkpointing (Model::saved_activations, the trainer's rule): a wrapped block keeps only its
  // input and recomputes the rest in its backward, one block at a time.
  std::vector<bool> wrapped;
  const std::vector<double> saved = b.model->saved_activations(
      query(cfg, l, cuda), units::parse_recompute(l.checkpointing), &wrapped);
  double fwd_flops = 0, recomputed = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    if (!wrapped[u]) continue;
    a.transient = std::max(a.transient, units[u].saved * mb);
    recomputed += b.unit_flops[u];
  }
  for (double f : b.unit_flops) fwd_flops += f;
  a.recompute_fraction = fwd_flops > 0 ? recomputed / fwd_flops : 0;
  // Per stage (chunk) of this rank: bytes per micro-batch.
  const int stages = static_cast<int>(st.bounds.size()) - 1;
  std::vector<double> per_stage(static_cast<std::size_t>(stages), 0.0);
  for (std::size_t u = 0; u < units.size(); ++u) {
    per_stage[static_cast<std::size_t>(st.stage_of_unit[u])] += saved[u] * mb;
  }
  // Backward temporaries: the first unit this rank's backward runs (its last) makes gradients of
  // about the size of what it saved, while every other activation is still alive.
  for (std::size_t u = units.size(); u-- > 0;) {
    if (st.rank_of_unit[u] != pp_rank) continue;
    a.transient = std::max(a.transient, units[u].saved * mb);
    break;
  }
  if (l.pp == 1) {
    a.peak = per_stage[0];
    return a;
  }
  // In flight: walk this rank's ops; F adds its stage's activations, B (zb: W, whose weight pass
  // still reads them) frees them.
  const bool split = st.schedule().split_backward();
  double live = 0;
  for (const auto& op : st.schedule().ops[static_cast<std::size_t>(pp_rank)]) {
    const double bytes = per_stage[static_cast<std::size_t>(op.stage)];
    if (op.kind == parallel::pipeline::OpKind::kForward) live += bytes;
    if ((op.kind == parallel::pipeline::OpKind::kBackward && !split) ||
        (op.kind == parallel::pipeline::OpKind::kWeight && split))
      live -= bytes;
    a.peak = std::max(a.peak, live);
  }
  // The message between stages: the last unit of stage 0's output.
  const int last0 = st.bounds[1] - 1;
  a.boundary = units[static_cast<std::size_t>(last0)].output * mb;
  return a;
}

RankMemory rank_memory(const Built& b, const Stages& st, const Candidate& l, int pp_rank,
                       const RunConfig& cfg, const Hardware& hw, StageElems& elems) {
  RankMemory rm;
  rm.rank = pp_rank * l.dp * l.tp;
  // The dp rank with the largest optimizer piece (ZeRO shards are uneven by a few elements).
  // That is dp rank 0: every dp rank holds the same parameter and gradient bytes, and its
  // optimizer piece is the real (unpadded) elements of its shard of each bucket, [d S, (d+1) S)
  // of [0, n): rank 0 has min(S, n) = S of them, which no rank exceeds (the padding sits at the
  // end). Evaluating one rank keeps a layout's cost independent of dp (a loop over the dp ranks
  // ran for minutes at --gpus 10^9; issue 35).
  const parallel::EngineMemory em = engine_bytes(b, st, l, 0, pp_rank, cfg);
  rm.params = em.params;
  rm.grads = em.grads;
  rm.optimizer = em.optimizer;
  // Autograd's own gradients (one rank, or grouped DDP buckets on GPUs) are dropped after each
  // step; flat buckets and ZeRO's shards persist.
  const bool autograd_grads = l.zero == 0 && (l.dp == 1 || !bucket_rules(cfg, hw.cuda).flat);
  rm.grads_at_backward = autograd_grads ? 0 : em.grads;
  const Activations a = activations(b, st, l, pp_rank, cfg, hw.cuda);
  rm.activations = a.peak;
  rm.transient = a.transient;
  double stage_params = 0, largest_unit_params = 0, stage_trainable = 0, stage_fp8 = 0;
  std::vector<double> unit_params(b.units.size(), 0.0);
  for (const auto& p : b.params) {
    if (st.rank_of_unit[static_cast<std::size_t>(p.unit)] != pp_rank) continue;
    stage_params += static_cast<double>(p.numel);
    if (p.fp8) stage_fp8 += static_cast<double>(p.numel);
    if (p.trainable) stage_trainable += static_cast<double>(p.numel);
    unit_params[static_cast<std::size_t>(p.unit)] += static_cast<double>(p.numel);
  }
  elems.params = stage_params;
  elems.trainable = stage_trainable;
  for (double x : unit_params) largest_unit_params = std::max(largest_unit_params, x);
  // Autocast keeps one low-precision copy of every weight the step uses (its cast cache).
  // Under fp8 the FP8 layers cast their (fp32) weights themselves, one FP8 copy per micro-batch
  // that autograd keeps until that micro-batch's backward: one at a time without a pipeline, at
  // most the schedule's in-flight micro-batches with one.
  if (optim::PrecisionPolicy::from(cfg.precision, c10::kCPU).autocast()) {
    double in_flight = 1;
    if (l.pp > 1)
      for (std::size_t s = 0; s < st.built->in_flight.size(); ++s)
        if (static_cast<int>(s) % l.pp == pp_rank)
          in_flight = std::max(in_flight, static_cast<double>(st.built->in_flight[s]));
    rm.autocast_copies = 2 * (stage_params - stage_fp8) + stage_fp8 * in_flight;
  }
  // ZeRO-3 gathers a unit (and prefetches the next) in fp32.
  if (l.zero == 3 && l.dp > 1) rm.comm_buffers = 2 * 4 * largest_unit_params;
  rm.context = hw.cuda ? hw.context_gib * kGiB : 0;
  return rm;
}

}  // namespace parallax::train::planner::detail
