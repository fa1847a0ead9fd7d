// The planner's time model and the prediction of one candidate (train/planner_predict.h): the
// trainer's own validation, the model and its partition, every pipeline rank's memory
// (planner_memory.cpp), the step time, and whether the peak fits the GPU.
#include "train/planner_predict.h"

namespace parallax::train::planner::detail {

namespace {

double bus_factor_all_reduce(int n) {
  return n > 1 ? 2.0 * (n - 1) / n : 0;
}
double bus_factor_gather(int n) {
  return n > 1 ? static_cast<double>(n - 1) / n : 0;
}

// The trainer's own validation of the combination: why `l` cannot run ("" when it can; keys and
// numbers in the message).
std::string plan_rejection(const RunConfig& cfg, const Candidate& l, const Hardware& hw) {
  try {
    parallel::ParallelConfig p = cfg.parallel;
    p.dp = l.dp;
    p.tp = l.tp;
    p.pp = l.pp;
    p.zero.stage = l.zero;
    p.sequence_parallel = l.sequence_parallel;
    if (l.pp > 1) p.pp_schedule = l.schedule;
    p.pp_virtual_stages = l.virtual_stages;
    (void)parallel::Plan::from(p, l.checkpointing, cfg.train.cuda_graph, l.dp * l.tp * l.pp,
                               hw.cuda ? hw.gpus_per_node() : 0, plan_transforms(cfg));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// The data-parallel collectives of a step (DDP's all-reduce; ZeRO's reduce-scatter and
// all-gathers) over bandwidth `bw`, and the part the backward (`backward_ms` per micro-batch) does
// not hide.
void data_parallel_time(const Candidate& l, double grad_bytes, double gather_bytes, double bw,
                        double lat, double backward_ms, StepTime& t) {
  const double m = l.micro_batches;
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

// The step time of `l` (stage_fwd_ms: one micro-batch's forward of each stage; elems: the
// largest pipeline rank's parameter elements): compute over the calibrated efficiency, the
// pipeline's bubble from the simulated schedule, and each group's collectives as its engine
// overlaps them.
StepTime step_time(Inventory& inv, const Built& b, const Stages& st, const Candidate& l,
                   const RunConfig& cfg, const Hardware& hw,
                   const std::vector<double>& stage_fwd_ms, const StageElems& elems) {
  const double mb = static_cast<double>(l.micro_batch), m = l.micro_batches;
  double worst_stage_fwd_ms = 0;
  for (double x : stage_fwd_ms) worst_stage_fwd_ms = std::max(worst_stage_fwd_ms, x);
  const auto query_units = b.model->unit_activations(query(cfg, l, hw.cuda));
  StepTime t;
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
  const int world = l.dp * l.tp * l.pp;
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
      if (!query_units[u].recomputable || st.rank_of_unit[u] != 0) continue;
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
  const double grad_bytes = 4 * elems.trainable;
  const double gather_bytes = 4 * (l.zero == 3 ? elems.params : elems.trainable);
  if (l.dp > 1) {
    const double backward_ms = t.compute_ms / m * (1.0 + recompute) / (2.0 + recompute);
    data_parallel_time(l, grad_bytes, gather_bytes, bw_of(l.dp * l.tp), lat, backward_ms, t);
  }
  // The optimizer update: ~8 fp32 reads/writes per element of this rank's optimizer piece.
  double opt_elems = elems.trainable;
  if (l.zero >= 1 && l.dp > 1) opt_elems /= l.dp;
  const double hbm = hw.cuda ? 2500e9 : 10e9;
  t.optimizer_ms = opt_elems * 32 / hbm * 1e3;
  if (l.pp > 1) t.compute_ms += m * hw.overhead_ms;
  t.step_ms =
      t.compute_ms + t.bubble_ms + t.tp_comm_ms + t.pp_comm_ms + t.dp_exposed_ms + t.optimizer_ms;
  t.samples_per_s = static_cast<double>(l.micro_batch) * l.micro_batches * l.dp / (t.step_ms / 1e3);
  return t;
}

}  // namespace

Row predict_with(Inventory& inv, const RunConfig& cfg, const Candidate& l, const Hardware& hw) {
  Row row;
  row.layout = l;
  row.reason = plan_rejection(cfg, l, hw);
  if (!row.reason.empty()) return row;
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
  // One micro-batch's forward of each stage (chunk), ms.
  const double ms_per_flop = 1e3 / (hw.peak_tflops * 1e12 * hw.efficiency);
  const double mb = static_cast<double>(l.micro_batch);
  std::vector<double> stage_fwd_ms(st.bounds.size() - 1, 0.0);
  for (std::size_t u = 0; u < b.units.size(); ++u)
    stage_fwd_ms[static_cast<std::size_t>(st.stage_of_unit[u])] +=
        b.unit_flops[u] * mb / l.tp * ms_per_flop;

  double max_peak = -1;
  StageElems largest;  // the largest pipeline rank's parameters, which the collectives move
  for (int r = 0; r < l.pp; ++r) {
    StageElems elems;
    const RankMemory rm = rank_memory(b, st, l, r, cfg, hw, elems);
    largest.params = std::max(largest.params, elems.params);
    largest.trainable = std::max(largest.trainable, elems.trainable);
    row.ranks.push_back(rm);
    if (rm.total() > max_peak) {
      max_peak = rm.total();
      row.peak = rm;
    }
  }
  row.time = step_time(inv, b, st, l, cfg, hw, stage_fwd_ms, largest);

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

}  // namespace parallax::train::planner::detail
