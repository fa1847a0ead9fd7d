#include "train/planner_inventory.h"

namespace parallax::train::planner {

namespace comm = parallel::comm;
using namespace detail;

namespace {

// The pipeline stages of `b` for `layout`: stage_of[u], and the schedule (pp > 1).
struct Stages {
  std::vector<int> bounds;  // stage s: units [bounds[s], bounds[s + 1])
  std::shared_ptr<const BuiltSchedule> built;
  std::vector<int> rank_of_unit;
  std::vector<int> stage_of_unit;
  const parallel::pipeline::Schedule& schedule() const { return built->schedule; }
};

models::ActivationQuery query(const RunConfig& cfg, const Layout& l, bool cuda) {
  models::ActivationQuery q;
  q.compute_bytes = optim::make_precision_policy(cfg.precision, c10::kCPU).compute_bytes();
  q.fp8 = optim::parse_precision(cfg.precision.mode) == optim::Precision::kFp8;
  q.cuda = cuda;
  q.tp = l.tp;
  q.sequence_parallel = l.sequence_parallel && l.tp > 1;
  return q;
}

Stages make_stages(const Built& b, const Layout& l, const RunConfig& cfg, bool cuda,
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
        b.model->saved_activations(query(cfg, l, cuda), core::parse_checkpointing(l.checkpointing)),
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

// Exact engine memory of the rank at (dp_rank, pp_rank) (every tp rank of an even split holds the
// same shapes): the engine's own rule (parallel::predicted_memory) on this rank's parameters.
parallel::EngineMemory engine_bytes(const Built& b, const Stages& st, const Layout& l, int dp_rank,
                                    int pp_rank, const RunConfig& cfg) {
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

// The activation model of `b` under `l` on pipeline rank `pp_rank`: the peak of saved bytes over
// the schedule, and the largest transient.
struct Activations {
  double peak = 0, transient = 0, boundary = 0;  // boundary: a pipeline message, bytes
  double recompute_fraction = 0;                 // forward FLOPs recomputed / forward FLOPs
};

Activations activations(const Built& b, const Stages& st, const Layout& l, int pp_rank,
                        const RunConfig& cfg, bool cuda) {
  Activations a;
  const auto units = b.model->unit_activations(query(cfg, l, cuda));
  if (units.size() != b.units.size()) return a;
  const double mb = static_cast<double>(l.micro_batch);
  // Checkpointing (Model::saved_activations, the trainer's rule): a wrapped block keeps only its
  // input and recomputes the rest in its backward, one block at a time.
  std::vector<bool> wrapped;
  const std::vector<double> saved = b.model->saved_activations(
      query(cfg, l, cuda), core::parse_checkpointing(l.checkpointing), &wrapped);
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

double bus_factor_all_reduce(int n) {
  return n > 1 ? 2.0 * (n - 1) / n : 0;
}
double bus_factor_gather(int n) {
  return n > 1 ? static_cast<double>(n - 1) / n : 0;
}

}  // namespace

std::string Layout::overrides() const {
  std::string s = fmt::format("parallel.dp={} parallel.tp={} parallel.pp={} parallel.zero.stage={}",
                              dp, tp, pp, zero);
  if (tp > 1)
    s += fmt::format(" parallel.sequence_parallel={}", sequence_parallel ? "true" : "false");
  if (pp > 1) s += fmt::format(" parallel.pp_schedule={}", schedule);
  if (virtual_stages > 1) s += fmt::format(" parallel.pp_virtual_stages={}", virtual_stages);
  s += fmt::format(" data.batch_size={} train.grad_accum={} train.activation_checkpointing={}",
                   micro_batch, micro_batches, checkpointing);
  return s;
}

Layout configured_layout(const RunConfig& cfg, int world) {
  const auto& p = cfg.parallel;
  Layout l;
  l.tp = p.tp;
  l.pp = p.pp;
  l.dp = p.dp > 0 ? p.dp : std::max(1, world / (p.tp * p.pp));
  l.zero = p.zero.stage;
  l.sequence_parallel = p.sequence_parallel;
  l.micro_batch = cfg.data.batch_size;
  l.micro_batches = cfg.train.grad_accum;
  l.schedule = p.pp > 1 ? p.pp_schedule : "";
  l.virtual_stages = p.pp_virtual_stages;
  l.checkpointing = cfg.train.activation_checkpointing;
  return l;
}

namespace {

Row predict_with(Inventory& inv, const RunConfig& cfg, const Layout& l, const Hardware& hw) {
  Row row;
  row.layout = l;
  const int world = l.dp * l.tp * l.pp;
  // The trainer's own validation of the combination (keys and numbers in the message).
  try {
    parallel::ParallelConfig p = cfg.parallel;
    p.dp = l.dp;
    p.tp = l.tp;
    p.pp = l.pp;
    p.zero.stage = l.zero;
    p.sequence_parallel = l.sequence_parallel;
    if (l.pp > 1) p.pp_schedule = l.schedule;
    p.pp_virtual_stages = l.virtual_stages;
    (void)parallel::Plan::from(p, l.checkpointing, cfg.train.cuda_graph, world,
                               hw.cuda ? hw.gpus_per_node() : 0, plan_transforms(cfg));
  } catch (const Error& e) {
    row.reason = e.what();
    return row;
  }
  const Built& b = inv.at_tp(l.tp, l.sequence_parallel);
  if (!b.error.empty()) {
    row.reason = b.error;
    return row;
  }
  if (l.pp > 1 && b.chain == 0) {
    row.reason = fmt::format("model '{}' cannot be split into pipeline stages", cfg.model.name);
    return row;
  }
  Stages st;
  try {
    st = make_stages(b, l, cfg, hw.cuda, inv.schedules());
  } catch (const Error& e) {
    row.reason = e.what();
    return row;
  }
  const bool bf = optim::parse_precision(cfg.precision.mode) != optim::Precision::kFp32;
  const double step_flops_unit = 1e3 / (hw.peak_tflops * 1e12 * hw.efficiency);  // ms per FLOP
  const double mb = static_cast<double>(l.micro_batch), m = l.micro_batches;
  double worst_stage_fwd_ms = 0;
  std::vector<double> stage_fwd_ms(st.bounds.size() - 1, 0.0);
  for (std::size_t u = 0; u < b.units.size(); ++u)
    stage_fwd_ms[static_cast<std::size_t>(st.stage_of_unit[u])] +=
        b.unit_flops[u] * mb / l.tp * step_flops_unit;
  for (double x : stage_fwd_ms) worst_stage_fwd_ms = std::max(worst_stage_fwd_ms, x);

  const auto query_units = b.model->unit_activations(query(cfg, l, hw.cuda));
  double max_peak = -1, max_stage_elems = 0, max_trainable_elems = 0;
  for (int r = 0; r < l.pp; ++r) {
    RankMemory rm;
    rm.rank = r * l.dp * l.tp;
    // The dp rank with the largest optimizer piece (ZeRO shards are uneven by a few elements).
    // That is dp rank 0: every dp rank holds the same parameter and gradient bytes, and its
    // optimizer piece is the real (unpadded) elements of its shard of each bucket, [d S, (d+1) S)
    // of [0, n): rank 0 has min(S, n) = S of them, which no rank exceeds (the padding sits at the
    // end). Evaluating one rank keeps a layout's cost independent of dp (a loop over the dp ranks
    // ran for minutes at --gpus 10^9; issue 35).
    const parallel::EngineMemory em = engine_bytes(b, st, l, 0, r, cfg);
    rm.params = em.params;
    rm.grads = em.grads;
    rm.optimizer = em.optimizer;
    // Autograd's own gradients (one rank, or grouped DDP buckets on GPUs) are dropped after each
    // step; flat buckets and ZeRO's shards persist.
    const bool autograd_grads = l.zero == 0 && (l.dp == 1 || !bucket_rules(cfg, hw.cuda).flat);
    rm.grads_at_backward = autograd_grads ? 0 : em.grads;
    const Activations a = activations(b, st, l, r, cfg, hw.cuda);
    rm.activations = a.peak;
    rm.transient = a.transient;
    double stage_params = 0, largest_unit_params = 0, stage_trainable = 0, stage_fp8 = 0;
    std::vector<double> unit_params(b.units.size(), 0.0);
    for (const auto& p : b.params) {
      if (st.rank_of_unit[static_cast<std::size_t>(p.unit)] != r) continue;
      stage_params += static_cast<double>(p.numel);
      if (p.fp8) stage_fp8 += static_cast<double>(p.numel);
      if (p.trainable) stage_trainable += static_cast<double>(p.numel);
      unit_params[static_cast<std::size_t>(p.unit)] += static_cast<double>(p.numel);
    }
    max_stage_elems = std::max(max_stage_elems, stage_params);
    max_trainable_elems = std::max(max_trainable_elems, stage_trainable);
    for (double x : unit_params) largest_unit_params = std::max(largest_unit_params, x);
    // Autocast keeps one low-precision copy of every weight the step uses (its cast cache).
    // Under fp8 the FP8 layers cast their (fp32) weights themselves, one FP8 copy per micro-batch
    // that autograd keeps until that micro-batch's backward: one at a time without a pipeline, at
    // most the schedule's in-flight micro-batches with one.
    if (bf) {
      double in_flight = 1;
      if (l.pp > 1)
        for (std::size_t s = 0; s < st.built->in_flight.size(); ++s)
          if (static_cast<int>(s) % l.pp == r)
            in_flight = std::max(in_flight, static_cast<double>(st.built->in_flight[s]));
      rm.autocast_copies = 2 * (stage_params - stage_fp8) + stage_fp8 * in_flight;
    }
    // ZeRO-3 gathers a unit (and prefetches the next) in fp32.
    if (l.zero == 3 && l.dp > 1) rm.comm_buffers = 2 * 4 * largest_unit_params;
    rm.context = hw.cuda ? hw.context_gib * kGiB : 0;
    row.ranks.push_back(rm);
    if (rm.total() > max_peak) {
      max_peak = rm.total();
      row.peak = rm;
    }
  }

  // ---- time ----
  StepTime& t = row.time;
  const Activations a0 = activations(b, st, l, 0, cfg, hw.cuda);
  const double recompute = 1.0 + a0.recompute_fraction;  // forward passes per micro-batch
  double rank_fwd_ms = 0;
  for (std::size_t s = 0; s < stage_fwd_ms.size(); ++s)
    if (static_cast<int>(s) % l.pp == 0 || l.pp == 1) rank_fwd_ms += stage_fwd_ms[s];
  if (l.pp > 1) {
    // The schedule simulated with the slowest stage's costs (F, B = 2F; zb: B = W = F).
    const bool split = st.schedule().split_backward();
    const double f = worst_stage_fwd_ms, bw = split ? f * recompute : 2 * f + (recompute - 1) * f;
    const auto [makespan, busy] = inv.schedules().simulate(st.built, f, bw, split ? f : 0);
    t.compute_ms = busy;
    t.bubble_ms = makespan - busy;
  } else {
    // A micro-batch costs its compute plus the fixed cost, but never less than the host floor
    // (the launches of a step whose kernels finish faster than the host issues them).
    t.compute_ms = m * std::max(hw.host_floor_ms, rank_fwd_ms * (2.0 + recompute) + hw.overhead_ms);
  }
  const int gpn = hw.cuda ? hw.gpus_per_node() : world;
  const auto bw_of = [&](int span) {
    return (span <= gpn ? hw.intra_node_gbps : hw.inter_node_gbps) * 1e9;
  };
  const double lat = hw.latency_us * 1e-3;
  // Tensor parallel: the blocks' all-reduces (or SP's all-gather + reduce-scatter, the same
  // bytes), two per block forward and two backward, on the critical path.
  if (l.tp > 1) {
    double bytes = 0;
    int collectives = 0;
    for (std::size_t u = 0; u < query_units.size(); ++u) {
      if (!query_units[u].checkpointable || st.rank_of_unit[u] != 0) continue;
      const double msg = query_units[u].output * mb * (l.sequence_parallel ? l.tp : 1);
      bytes += 4 * msg;
      collectives += 4;
    }
    t.tp_comm_ms =
        m * (bytes * bus_factor_all_reduce(l.tp) / bw_of(l.tp) * 1e3 + collectives * lat);
  }
  if (l.pp > 1) {
    const double span = static_cast<double>(world);
    t.pp_comm_ms = 2 * (m + l.pp - 1) * (a0.boundary / bw_of(static_cast<int>(span)) * 1e3 + lat);
  }
  // Data parallel: the largest stage's trainable gradients (reduced) and parameters (gathered:
  // the trainable flat buffers after the step under ZeRO-1/2, every parameter under ZeRO-3).
  const double grad_bytes = 4 * max_trainable_elems;
  const double gather_bytes = 4 * (l.zero == 3 ? max_stage_elems : max_trainable_elems);
  if (l.dp > 1) {
    const double bw = bw_of(l.dp * l.tp);
    const double backward_ms = t.compute_ms / m * (1.0 + recompute) / (2.0 + recompute);
    if (l.zero == 0) {
      t.dp_comm_ms = grad_bytes * bus_factor_all_reduce(l.dp) / bw * 1e3;
      t.dp_exposed_ms = std::max(0.0, t.dp_comm_ms - backward_ms) + lat;
    } else {
      const double rs = grad_bytes * bus_factor_gather(l.dp) / bw * 1e3;
      const double ag = gather_bytes * bus_factor_gather(l.dp) / bw * 1e3;
      if (l.zero == 1) {
        t.dp_comm_ms = rs + ag;
        t.dp_exposed_ms = std::max(0.0, rs - backward_ms) + ag;
      } else if (l.zero == 2) {
        t.dp_comm_ms = m * rs + ag;
        t.dp_exposed_ms = std::max(0.0, m * rs - m * backward_ms) + ag;
      } else {
        // Stage 3: per micro-batch, gathers before forward and backward (prefetched), and the
        // gradients' reduce-scatter.
        t.dp_comm_ms = m * (2 * ag + rs);
        t.dp_exposed_ms = std::max(0.0, t.dp_comm_ms - t.compute_ms);
      }
    }
  }
  // The optimizer update: ~8 fp32 reads/writes per element of this rank's optimizer piece.
  double opt_elems = max_trainable_elems;
  if (l.zero >= 1 && l.dp > 1) opt_elems /= l.dp;
  const double hbm = hw.cuda ? 2500e9 : 10e9;
  t.optimizer_ms = opt_elems * 32 / hbm * 1e3;
  if (l.pp > 1) t.compute_ms += m * hw.overhead_ms;
  t.step_ms =
      t.compute_ms + t.bubble_ms + t.tp_comm_ms + t.pp_comm_ms + t.dp_exposed_ms + t.optimizer_ms;
  t.samples_per_s = static_cast<double>(l.micro_batch) * l.micro_batches * l.dp / (t.step_ms / 1e3);

  const double limit = hw.gpu_mem_gib * kGiB;
  row.fits = row.peak.total() <= limit;
  if (!row.fits) {
    row.reason = fmt::format(
        "needs {:.1f} GiB on rank {} (params {:.1f}, grads {:.1f}, optimizer {:.1f}, "
        "activations {:.1f}, other {:.1f}) > {:.0f} GiB",
        row.peak.total() / kGiB, row.peak.rank, row.peak.params / kGiB, row.peak.grads / kGiB,
        row.peak.optimizer / kGiB, row.peak.activations / kGiB,
        (row.peak.autocast_copies + row.peak.transient + row.peak.comm_buffers + row.peak.context) /
            kGiB,
        hw.gpu_mem_gib);
  }
  return row;
}

// Why no layout of (dp, tp, pp) can run, whatever its ZeRO stage, sequence parallelism, schedule,
// micro-batches and checkpointing ("" when some may): the topology (a tp group across nodes),
// a model that cannot be built at this tp with or without SP, or fewer units than pipeline
// stages. The reasons are the ones predict_with() would give each of its layouts.
std::string pair_rejection(Inventory& inv, const RunConfig& cfg, const Hardware& hw, int dp, int tp,
                           int pp) {
  try {
    (void)comm::resolve_layout(dp * tp * pp, dp, tp, pp, hw.cuda ? hw.gpus_per_node() : 0);
  } catch (const Error& e) {
    return e.what();
  }
  const Built& plain = inv.at_tp(tp, false);
  const Built* b = &plain;
  if (!plain.error.empty()) {
    if (tp == 1) return plain.error;
    b = &inv.at_tp(tp, true);
    if (!b->error.empty()) return plain.error;
  }
  if (pp > 1 && cfg.lora.rank == 0 && b->chain != 0 && static_cast<int>(b->pp_costs.size()) < pp) {
    return fmt::format(
        "keys 'parallel.pp' and 'parallel.pp_virtual_stages': {} pipeline stages but the model "
        "has only {} units to spread over them",
        pp, b->pp_costs.size());
  }
  return "";
}

// Ascending; O(sqrt n).
std::vector<int> divisors(int n) {
  std::vector<int> lo, hi;
  for (int i = 1; static_cast<int64_t>(i) * i <= n; ++i) {
    if (n % i != 0) continue;
    lo.push_back(i);
    if (i != n / i) hi.push_back(n / i);
  }
  lo.insert(lo.end(), hi.rbegin(), hi.rend());
  return lo;
}

}  // namespace

namespace {

// FP8 needs GPUs (the trainer's own refusal, before anything is built).
void check_precision(const RunConfig& cfg, const Hardware& hw) {
  PARALLAX_CHECK(hw.cuda || optim::parse_precision(cfg.precision.mode) != optim::Precision::kFp8,
                 ConfigError,
                 "key 'precision.mode': fp8 needs NVIDIA GPUs with FP8 tensor cores, not CPU "
                 "ranks; plan with --device h100 or h200, or use precision.mode=bf16");
}

}  // namespace

Row predict(const RunConfig& cfg, const Layout& layout, const Hardware& hw) {
  check_supported(cfg);
  check_precision(cfg, hw);
  Inventory inv(cfg);
  return predict_with(inv, cfg, layout, hw);
}

std::vector<parallel::EngineMemory> engine_memory(const RunConfig& cfg, int world, bool cuda) {
  check_supported(cfg);
  const Layout l = configured_layout(cfg, world);
  PARALLAX_CHECK(l.dp * l.tp * l.pp == world, ConfigError,
                 "planner: dp {} x tp {} x pp {} is not the world of {} ranks", l.dp, l.tp, l.pp,
                 world);
  Inventory inv(cfg);
  const Built& b = inv.at_tp(l.tp, l.sequence_parallel);
  PARALLAX_CHECK(b.error.empty(), ConfigError, "{}", b.error);
  const Stages st = make_stages(b, l, cfg, cuda, inv.schedules());
  std::vector<parallel::EngineMemory> out(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    const int dp_rank = (r / l.tp) % l.dp, pp_rank = r / (l.tp * l.dp);
    out[static_cast<std::size_t>(r)] = engine_bytes(b, st, l, dp_rank, pp_rank, cfg);
  }
  return out;
}

double activation_bytes(const RunConfig& cfg, int tp, bool sequence_parallel, int64_t micro_batch,
                        bool cuda) {
  Layout l;
  l.tp = tp;
  l.sequence_parallel = sequence_parallel;
  l.micro_batch = micro_batch;
  Inventory inv(cfg);
  const Built& b = inv.at_tp(tp, sequence_parallel);
  PARALLAX_CHECK(b.error.empty(), ConfigError, "{}", b.error);
  const Stages st = make_stages(b, l, cfg, cuda, inv.schedules());
  return activations(b, st, l, 0, cfg, cuda).peak;
}

std::vector<Row> plan(const RunConfig& cfg, const Request& req) {
  check_supported(cfg);
  const Hardware& hw = req.hw;
  check_precision(cfg, hw);
  const int n = hw.gpus;
  PARALLAX_CHECK(n >= 1 && hw.nodes >= 1 && n % hw.nodes == 0, UsageError,
                 "plan: --gpus {} must be a positive multiple of --nodes {}", n, hw.nodes);
  PARALLAX_CHECK(n <= kMaxGpus, UsageError,
                 "plan: --gpus {} is more than {} (the largest clusters built have ~100k GPUs)", n,
                 kMaxGpus);
  PARALLAX_CHECK(req.global_batch >= 0 && req.global_batch <= kMaxGlobalBatch, UsageError,
                 "plan: --global-batch {} must be in 1..{}", req.global_batch, kMaxGlobalBatch);
  const Layout cfg_layout = configured_layout(cfg, n);
  int64_t global = req.global_batch;
  if (global <= 0) {
    // In double first: data.batch_size x train.grad_accum x dp overflows int64 for int keys.
    const int dp = std::max(1, n / (cfg.parallel.tp * cfg.parallel.pp));
    const double g = static_cast<double>(cfg.data.batch_size) * cfg.train.grad_accum * dp;
    PARALLAX_CHECK(g <= static_cast<double>(kMaxGlobalBatch), ConfigError,
                   "keys 'data.batch_size' and 'train.grad_accum': the global batch {} x {} x {} "
                   "data-parallel ranks = {:.0f} samples is more than {} (a layout's micro-batch "
                   "size and count are 32-bit keys); pass a smaller --global-batch",
                   cfg.data.batch_size, cfg.train.grad_accum, dp, g, kMaxGlobalBatch);
    global = static_cast<int64_t>(g);
  }
  Inventory inv(cfg);
  // A model that cannot be built even without tensor parallelism (a LoRA rank above its layers,
  // a target that matches nothing) is the config's error, not every layout's reason.
  if (const Built& plain = inv.at_tp(1, false); !plain.error.empty())
    throw_error<ConfigError>("{}", plain.error);
  std::vector<Row> rows;
  const std::vector<std::string> ckpts =
      req.all_checkpointing ? std::vector<std::string>{"none", "selective", "full"}
                            : std::vector<std::string>{cfg.train.activation_checkpointing};
  for (int tp : divisors(n)) {
    for (int pp : divisors(n / tp)) {
      inv.schedules().clear();
      const int dp = n / (tp * pp);
      if (global % dp != 0) {
        Row r;
        r.layout.dp = dp;
        r.layout.tp = tp;
        r.layout.pp = pp;
        r.reason = fmt::format("global batch {} is not divisible by dp {}", global, dp);
        rows.push_back(r);
        continue;
      }
      // A (dp, tp, pp) that no choice of the other knobs can run is one row, not one per ZeRO
      // stage, schedule, micro-batch and checkpointing: otherwise the rows grow with the divisor
      // pairs of --gpus times ~10^3 (--gpus 110880: 10^6 rows, 2 GB, 11 s; issue 35).
      if (std::string why = pair_rejection(inv, cfg, hw, dp, tp, pp); !why.empty()) {
        Row r;
        r.layout.dp = dp;
        r.layout.tp = tp;
        r.layout.pp = pp;
        r.reason = std::move(why);
        rows.push_back(std::move(r));
        continue;
      }
      const int64_t per_dp = global / dp;
      std::vector<int64_t> micro;
      for (int64_t mb = 1; mb <= per_dp; mb *= 2)
        if (per_dp % mb == 0) micro.push_back(mb);
      if (std::find(micro.begin(), micro.end(), per_dp) == micro.end()) micro.push_back(per_dp);
      std::vector<std::pair<std::string, int>> schedules{{"", 1}};
      if (pp > 1) schedules = {{"1f1b", 1}, {"gpipe", 1}, {"interleaved", 2}, {"zb", 1}};
      for (int zero : {0, 1, 2, 3}) {
        if (dp == 1 && zero > 0) continue;  // ZeRO over one rank is DDP's memory
        for (bool sp : tp > 1 ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
          for (const auto& [sched, v] : schedules) {
            for (int64_t mb : micro) {
              const int m = static_cast<int>(per_dp / mb);
              // With pp = 1 more micro-batches only cost time: keep the largest that fits (the
              // ranking keeps the best); with pp they fill the pipeline.
              for (const auto& ck : ckpts) {
                Layout l;
                l.dp = dp;
                l.tp = tp;
                l.pp = pp;
                l.zero = zero;
                l.sequence_parallel = sp;
                l.micro_batch = mb;
                l.micro_batches = m;
                l.schedule = sched;
                l.virtual_stages = v;
                l.checkpointing = ck;
                Row r = predict_with(inv, cfg, l, hw);
                r.configured = l.dp == cfg_layout.dp && l.tp == cfg_layout.tp &&
                               l.pp == cfg_layout.pp && l.zero == cfg_layout.zero &&
                               l.micro_batch == cfg_layout.micro_batch &&
                               l.micro_batches == cfg_layout.micro_batches &&
                               l.checkpointing == cfg_layout.checkpointing &&
                               (pp == 1 || l.schedule == cfg_layout.schedule) &&
                               (tp == 1 || sp == cfg_layout.sequence_parallel);
                rows.push_back(std::move(r));
              }
            }
          }
        }
      }
    }
  }
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.fits) return a.time.samples_per_s > b.time.samples_per_s;
    return a.reason.empty() < b.reason.empty();
  });
  return rows;
}

}  // namespace parallax::train::planner
