// What happens in a run's loop every N steps (train/cadence.h).
#include "train/cadence.h"

#include "checkpoint/checkpointer.h"
#include "checkpoint/save_state.h"
#include "checkpoint/training_state.h"
#include "checkpoint/weights.h"
#include "comm/topology.h"
#include "comm/world.h"
#include "core/build_info.h"
#include "core/log.h"
#include "core/strings.h"
#include "parallel/engine.h"
#include "train/batch_source.h"
#include "train/evaluate.h"
#include "train/metrics.h"
#include "train/preemption.h"
#include "train/run_steps.h"

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>

namespace parallax::train::detail {

namespace fs = std::filesystem;
namespace ck = checkpoint;

namespace {

// Adds `pieces` (boxes or flat ranges) to a save under `prefix`; returns their bytes.
int64_t add_pieces(ck::SaveState& state, const std::string& prefix,
                   const std::vector<parallel::StatePiece>& pieces) {
  int64_t bytes = 0;
  for (const auto& piece : pieces) {
    const std::string name = prefix + piece.name;
    if (piece.flat_begin >= 0) {
      state.add_flat_shard(name, piece.tensor, piece.global_shape, piece.flat_begin,
                           piece.replicas);
    } else {
      state.add_shard(name, piece.tensor, piece.global_shape, piece.offsets, piece.replicas);
    }
    bytes += static_cast<int64_t>(piece.tensor.nbytes());
  }
  return bytes;
}

void run_plot_tool(const fs::path& run_dir) {
  const fs::path tool = fs::path(core::source_dir()) / "tools" / "plot_metrics.py";
  std::error_code ec;
  if (!fs::exists(tool, ec)) {
    core::log::warn("plots skipped: '{}' not found", tool.string());
    return;
  }
  const std::string cmd =
      fmt::format("'{}' '{}' '{}' 2>&1", core::python_exe(), tool.string(), run_dir.string());
  std::string output;
  int rc = -1;
  if (std::FILE* pipe = popen(cmd.c_str(), "r")) {
    char buf[512];
    while (std::fgets(buf, sizeof(buf), pipe)) output += buf;
    rc = pclose(pipe);
  }
  if (rc != 0) {
    const std::string last = core::trim(
        output.substr(output.rfind('\n', output.size() >= 2 ? output.size() - 2 : 0) + 1));
    core::log::warn("plots skipped: '{}' failed: {}", cmd, last.empty() ? "no output" : last);
  } else {
    core::log::info("plots: {}", (run_dir / "plots").string());
  }
}

}  // namespace

Cadence::Cadence(Run& run, int64_t total, bool loop)
    : run_(run),
      total_(total),
      profiler_(
          loop && run.cfg.train.profile_steps > 0
              ? std::max(run.cfg.train.profile_start, run.start_step + 1)
              : 0,
          loop ? run.cfg.train.profile_steps : 0, run.device.is_cuda(),
          (run.dir / "profile" / fmt::format("trace_rank{}.json", run.world->rank())).string()) {
  // Graceful preemption (train/preemption.h): every rank leaves the loop before the same step.
  if (loop && PreemptionSignals::installed()) {
    vote_ =
        std::make_unique<PreemptionVote>(*run.world_comm, run.device, run.cfg.parallel.timeout_s);
  }
}

Cadence::~Cadence() = default;

bool Cadence::stop_before(int64_t step) {
  // An evaluation stopped by preemption was agreed by every rank: stop here too, with its step.
  if (!eval_preempted_ && !(vote_ && vote_->should_stop())) return false;
  const int64_t done = step - 1;
  const int64_t every = run_.cfg.checkpoint.every;
  const bool saved = every > 0 && done % every == 0;
  if (done > run_.start_step && !saved) save(done);
  stopped_after_ = done;
  return true;
}

void Cadence::before_step(int64_t step) {
  profiler_.before(step);
}

void Cadence::after_step(int64_t step) {
  profiler_.after(step);
  if (run_.checkpointer) run_.checkpointer->poll();  // surfaces a failed background save
}

bool Cadence::evaluate_if_due(int64_t step) {
  const int64_t every = run_.cfg.train.eval_every;
  if (every <= 0 || step % every != 0 || step == total_) return false;
  evaluate(step);
  return true;
}

void Cadence::save_if_due(int64_t step) {
  // A checkpoint of step S is saved after S's metrics rows (save() makes them durable first), so
  // that resuming from S never loses nor repeats a row (metrics.h).
  const int64_t every = run_.cfg.checkpoint.every;
  if (every > 0 && step % every == 0 && step != total_) save(step);
}

std::map<std::string, double> evaluate_run(Run& run) {
  if (!run.evaluates()) return {};
  return train::evaluate(*run.model, run.cfg.data, run.scene,
                         static_cast<uint64_t>(run.cfg.experiment.seed), *run.topo->dp(),
                         run.device, run.precision);
}

void Cadence::evaluate(int64_t step) {
  if (!run_.evaluates()) return;
  // Evaluation runs a different number of batches per rank: no collective may happen inside it,
  // so ZeRO-3's parameters are gathered whole for its duration.
  parallel::FullParams whole(*run_.engine);
  std::map<std::string, double> m;
  try {
    m = evaluate_run(run_);
  } catch (const PreemptedError& e) {
    core::log::warn("{} (step {})", e.what(), step);
    eval_preempted_ = true;
    return;
  }
  run_.metrics->write("eval", step, m);
}

void Cadence::save(int64_t step) {
  if (!run_.checkpointer) return;
  // Rows of steps <= `step` reach the disk before this checkpoint can commit (and, async, before
  // the background commit starts): a run resumed from it finds every one of them (metrics.h).
  run_.metrics->sync();
  ck::SaveState state;
  // The model: whole and replicated, or (ZeRO-3) each rank's flat range of every parameter; only
  // the tensors the hooks keep (LoRA: the adapters).
  const int64_t model_bytes = add_pieces(state, ck::kModelPrefix, checkpointed_model(run_));
  if (run_.hooks.saves_model_tensor && !model_tensors_logged_) {
    core::log::info(
        "checkpoints hold {} of model tensors on this rank (what trains; the rest comes from the "
        "base)",
        core::human_bytes(static_cast<double>(model_bytes)));
    model_tensors_logged_ = true;
  }
  // The optimizer state per parameter under its global name and shape, as the engine holds it
  // (whole and replicated under DDP; one flat range of each parameter's state under ZeRO).
  add_pieces(state, ck::kOptimPrefix, run_.engine->checkpoint_optimizer());
  ck::add_rng(state);
  ck::add_loss_scaler(state, run_.precision.scaler());
  if (run_.hooks.save_extra) run_.hooks.save_extra(state);
  save_param_groups(run_, state);
  const auto pos = run_.source->position();
  state.set_extra("data.epoch", pos.first);
  state.set_extra("data.position", pos.second);
  run_.checkpointer->save(step, state);
  if (const auto st = run_.checkpointer->last_save(); st && st->step == step) {
    core::log::info("checkpoint step {} committed: {} ({:.2f} s)", step, st->path, st->total_s);
  } else {
    core::log::info("checkpoint step {}: writing in the background", step);
  }
}

void Cadence::loop_done() {
  vote_.reset();
}

void Cadence::wait_for_saves() {
  if (run_.checkpointer) run_.checkpointer->wait();
}

void Cadence::finish(int64_t step, double loss, double samples_per_s, double wall_s) {
  // The last record: tells followers (tools/tb_sidecar.py) the run is complete.
  std::map<std::string, double> row{{"loss", loss}, {"samples_per_s", samples_per_s}};
  if (wall_s >= 0) row["wall_s"] = wall_s;
  run_.metrics->write("summary", step, row);
  run_.world_comm->barrier();
  if (run_.rank0 && wall_s >= 0) {
    core::log::info("metrics: {}", (run_.dir / "metrics.jsonl").string());
    run_plot_tool(run_.dir);
  }
}

}  // namespace parallax::train::detail
