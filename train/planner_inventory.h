// Internal to the planner (train/planner.h is the API): what planner.cpp, planner_calibrate.cpp
// and planner_render.cpp share: the model inventory (the model built shape-only at each tp, its
// parameters, units, costs and pipeline schedules, cached per layout).
#pragma once

#include "train/planner_types.h"
#include "train/run_config.h"

#include "train/extension.h"
#include "train/run.h"

#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "core/timer.h"
#include "kernels/fp8.h"
#include "models/model.h"
#include "optim/precision.h"
#include "parallel/build_engine.h"
#include "parallel/ddp/ddp.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/schedule_check.h"
#include "parallel/plan.h"
#include "parallel/tensor/tensor_parallel.h"
#include "units/param_init.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>

namespace parallax::train::planner::detail {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// The model as one tp rank builds it: its parameters (registration order), units, costs.
struct Param {
  std::string name;
  int64_t numel = 0;
  int dim = 0;
  int unit = 0;
  bool tp_sharded = false;
  bool trainable = true;  // false: a frozen LoRA base weight
  bool fp8 = false;       // precision.mode=fp8: a weight its FP8 layer casts once per micro-batch
};
struct Built {
  std::string error;  // why the model cannot be built at this tp
  std::vector<Param> params;
  std::vector<units::Unit> units;
  std::vector<double> unit_flops;  // per sample
  std::vector<double> pp_costs;    // what the trainer balances pipeline stages by
  int chain = 0;
  double flops_per_sample = 0;
  std::shared_ptr<models::Model> model;
};

// A built pipeline schedule and what the partition reads from it.
struct BuiltSchedule {
  parallel::pipeline::Schedule schedule;
  std::vector<int> in_flight;  // in_flight_per_stage(schedule)
};

// Schedules, and their simulated timelines, shared by the layouts of one (tp, pp) that differ
// only in ZeRO stage, sequence parallelism or checkpointing: the same (kind, pp, micro-batches,
// virtual stages) is the same schedule, and the same stage costs give the same timeline. Without
// it a plan's time at large --gpus went into rebuilding and re-simulating them (issue 35).
// clear() between (tp, pp) pairs keeps it to one pair's schedules (each at most
// kMaxPipelineSlots compute slots per pass kind).
class ScheduleCache {
 public:
  std::shared_ptr<const BuiltSchedule> get(const Candidate& l) {
    const auto key = std::make_tuple(l.schedule, l.pp, l.micro_batches, l.virtual_stages);
    if (auto it = schedules_.find(key); it != schedules_.end()) return it->second;
    auto b = std::make_shared<BuiltSchedule>();
    b->schedule =
        parallel::pipeline::build_schedule(l.schedule, l.pp, l.micro_batches, l.virtual_stages);
    b->in_flight = parallel::pipeline::in_flight_per_stage(b->schedule);
    return schedules_.emplace(key, std::move(b)).first->second;
  }
  // simulate()'s makespan and busy time per rank.
  std::pair<double, double> simulate(const std::shared_ptr<const BuiltSchedule>& s, double f,
                                     double b, double w) {
    const auto key = std::make_tuple(s.get(), f, b, w);
    if (auto it = timelines_.find(key); it != timelines_.end()) return it->second;
    const auto tl = parallel::pipeline::simulate(s->schedule, f, b, w);
    return timelines_.emplace(key, std::make_pair(tl.makespan, tl.busy_per_rank)).first->second;
  }
  void clear() {
    schedules_.clear();
    timelines_.clear();
  }

 private:
  std::map<std::tuple<std::string, int, int, int>, std::shared_ptr<const BuiltSchedule>> schedules_;
  std::map<std::tuple<const BuiltSchedule*, double, double, double>, std::pair<double, double>>
      timelines_;
};

class Inventory {
 public:
  explicit Inventory(const RunConfig& cfg) : cfg_(cfg) {}

  ScheduleCache& schedules() { return schedules_; }

  const Built& at_tp(int tp, bool sp) {
    const auto key = std::make_pair(tp, sp && tp > 1);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    Built b;
    try {
      // The model as a run of this config builds it for `parallax plan` (train/run.h): shape-only,
      // with the extension's transform and the FP8 layers.
      RunOptions o;
      o.plan_tp = tp;
      o.plan_sequence_parallel = key.second;
      b.model = build_run(cfg_, Purpose::kPlan, o)->model;
    } catch (const ConfigError& e) {
      b.error = e.what();
      return cache_.emplace(key, std::move(b)).first->second;
    }
    const auto layouts = parallel::tensor::param_layouts(*b.model);
    b.units = b.model->units();
    std::map<std::string, int> unit_of;
    for (std::size_t u = 0; u < b.units.size(); ++u)
      for (const auto& n : b.units[u].param_names) unit_of[n] = static_cast<int>(u);
    std::set<std::string> fp8_weights;
    for (const auto& item : b.model->named_modules()) {
      if (kernels::fp8::fp8_child(*item.value()) != nullptr)
        fp8_weights.insert(item.key() + ".weight");
    }
    for (const auto& item : b.model->named_parameters()) {
      Param p;
      p.name = item.key();
      p.numel = item.value().numel();
      p.dim = static_cast<int>(item.value().dim());
      p.unit = unit_of.count(p.name) ? unit_of.at(p.name) : 0;
      p.tp_sharded = layouts.count(p.name) != 0;
      p.trainable = item.value().requires_grad();
      p.fp8 = fp8_weights.count(p.name) != 0;
      b.params.push_back(std::move(p));
    }
    b.chain = b.model->chain_length();
    b.flops_per_sample = b.model->forward_flops_per_sample();
    b.unit_flops = b.model->unit_flops();
    b.pp_costs = b.model->stage_costs();  // what the trainer partitions by
    if (b.unit_flops.size() != b.units.size()) {
      // Spread by parameters, as the trainer balances such models (+1 per unit).
      std::vector<double> w(b.units.size(), 1.0);
      double total = 0;
      for (const auto& p : b.params)
        w[static_cast<std::size_t>(p.unit)] += static_cast<double>(p.numel);
      for (double x : w) total += x;
      b.unit_flops.clear();
      for (double x : w) b.unit_flops.push_back(b.flops_per_sample * x / total);
    }
    return cache_.emplace(key, std::move(b)).first->second;
  }

 private:
  const RunConfig& cfg_;
  std::map<std::pair<int, bool>, Built> cache_;
  ScheduleCache schedules_;
};

// QAT and distillation are outside the planner's model: ConfigError naming the keys.
inline void check_supported(const RunConfig& cfg) {
  const Extension* e = active_extension(cfg);
  if (e == nullptr || e->planned()) return;
  std::vector<std::string> planned;
  for (const Extension* x : extensions()) {
    if (x->planned()) planned.push_back(x->title());
  }
  throw_error<ConfigError>(
      "parallax plan models plain{} training; key '{}' must be off in this version ({} is not in "
      "its memory model)",
      planned.empty() ? "" : " and " + core::join(planned, " and "), e->key(), e->title());
}

}  // namespace parallax::train::planner::detail
