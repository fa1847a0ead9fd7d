// build_run()'s resume (train/run_steps.h): which checkpoint a resume trusts (its shards'
// checksums verified under train.resume=auto), what it restores, and the config keys that changed
// since it was saved, named when a load fails.
#include "checkpoint/checksum_error.h"
#include "checkpoint/config_record.h"
#include "checkpoint/finite.h"
#include "checkpoint/format.h"
#include "checkpoint/training_state.h"
#include "checkpoint/weights.h"
#include "comm/agree.h"
#include "comm/world.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "core/timer.h"
#include "kernels/fp8.h"
#include "models/model.h"
#include "parallel/engine.h"
#include "parallel/parallelize.h"
#include "train/run_steps.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace parallax::train::detail {

namespace ck = checkpoint;

namespace {

// What fills `pieces` from a checkpoint under `prefix` (a flat range through the boxes it covers).
std::vector<ck::LoadTarget> load_targets(const std::string& prefix,
                                         const std::vector<parallel::StatePiece>& pieces) {
  std::vector<ck::LoadTarget> targets;
  for (const auto& piece : pieces) {
    const std::string name = prefix + piece.name;
    if (piece.flat_begin < 0) {
      targets.push_back(ck::LoadTarget{name, piece.tensor, piece.offsets});
      continue;
    }
    for (auto& t : ck::flat_load_targets(name, piece.tensor, piece.global_shape, piece.flat_begin))
      targets.push_back(std::move(t));
  }
  return targets;
}

// The checkpoint to resume from (ck::find_resume_point), agreed by every rank. Under
// train.resume=auto the ranks also stream the shards' checksums of the one chosen, each its share,
// and fall back to an older checkpoint (with a warning) when one does not match, as for a
// truncated shard. Warns (rank 0) that train.load_from is ignored when a checkpoint is found.
std::optional<ck::ResumePoint> choose_resume_point(const Run& run, const std::string& dir) {
  const RunConfig& cfg = run.cfg;
  // Steps whose shards failed verification, with the problem: skipped by the next choice and named
  // in its warning, as a truncated or missing shard is.
  std::map<int64_t, std::string> corrupt;
  while (true) {
    std::optional<ck::ResumePoint> point;
    const std::vector<int64_t> steps = comm::agree_on(
        *run.world_comm, run.device, "resume: choosing the checkpoint", [&]() -> int64_t {
          point = ck::find_resume_point(cfg.train.resume, dir, corrupt);
          return point ? point->step : -1;
        });
    // Ranks that chose differently (no shared filesystem) verify nothing: choose_resume refuses
    // them. An explicit checkpoint has no fallback: its shards are verified as they load.
    const bool agreed =
        std::all_of(steps.begin(), steps.end(), [&](int64_t s) { return s == steps.front(); });
    if (agreed && point && cfg.train.resume == "auto") {
      try {
        // The ranks share the reading (rank r: the rank files r, r + world, ...), so a resume
        // reads the checkpoint once more in all, not once more per rank.
        comm::agree_on(
            *run.world_comm, run.device,
            fmt::format("resume: verifying the checksums of '{}'", point->path), [&]() -> int64_t {
              core::Stopwatch clock;
              const int64_t bytes =
                  ck::verify_checkpoint_part(point->path, run.world->rank(), run.world->size());
              core::log::info("resume: {} of '{}' verified in {:.2f} s on rank {}",
                              core::human_bytes(static_cast<double>(bytes)), point->path,
                              clock.elapsed_s(), run.world->rank());
              return 0;
            });
      } catch (const CheckpointError& e) {
        // The same error on every rank (agree_on): each one drops this step alike.
        corrupt[point->step] = e.what();
        continue;
      }
    }
    if (point && !cfg.train.load_from.empty() && !run.hooks.saves_model_tensor && run.rank0) {
      // torchtitan and mmengine do the same: a job that starts from pretrained weights and is
      // resubmitted with train.resume=auto continues its own training.
      core::log::warn(
          "train.load_from '{}' is ignored: the run resumes from '{}' (step {}), which holds the "
          "trained model (train.resume wins; train.resume='' starts from train.load_from)",
          cfg.train.load_from, point->path, point->step);
    }
    return point;
  }
}

// Warns (rank 0) about each key of the run's config that differs from the config the checkpoint
// was saved with, and keeps the list for with_config_hint.
void compare_config(Run& run) {
  const std::string where = run.resume->dir();
  const std::optional<std::string> saved = run.resume->config_text();
  if (!saved) {
    // Saved before checkpoints kept their config: only the hash can tell.
    if (run.rank0 && run.resume->metadata().config_hash != core::stable_hash(run.config_text)) {
      core::log::warn(
          "resuming from {} (step {}): its config hash differs from this run's, and it was saved "
          "without its config, so the changed keys are unknown",
          where, run.start_step);
    }
    return;
  }
  // train.resume is how a resume is asked for: it differs by nature.
  run.config_changes =
      ck::diff_configs(*saved, run.config_text, {"train.resume"},
                       fmt::format("'{}/{}'", where, ck::kConfigFile), "this run's config");
  if (run.rank0 && !run.config_changes.empty()) {
    core::log::warn(
        "resuming from step {} with a config that differs from the checkpoint's ({}/{}): {}",
        run.start_step, where, ck::kConfigFile, ck::describe_changes(run.config_changes));
  }
}

// A checkpoint committed before non-finite saves were refused may hold NaN: refuse to train on.
void check_resumed_state_finite(const Run& run) {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& piece : run.engine->checkpoint_model(*run.model))
    state.emplace_back("model/" + piece.name, piece.tensor);
  for (const auto& [k, t] : run.engine->optimizer().state()) state.emplace_back("optim/" + k, t);
  std::vector<at::Tensor> tensors;
  for (const auto& [k, t] : state) tensors.push_back(t.detach());
  const int64_t bad = ck::first_nonfinite(tensors, /*parallel=*/true);
  if (bad < 0) return;
  const auto count = ck::count_nonfinite(tensors[static_cast<std::size_t>(bad)]);
  throw_error<CheckpointError>(
      "checkpoint '{}' (step {}): tensor '{}' holds {} NaN and {} infinite value(s); "
      "resume from an earlier checkpoint (train.resume=<its path>)",
      run.resume->dir(), run.start_step, state[static_cast<std::size_t>(bad)].first, count.nan,
      count.inf);
}

// Each rank reads exactly the optimizer state pieces it holds (a ZeRO rank: one flat range of each
// state tensor, read as the boxes it covers), from whatever shards of whatever layout overlap
// them.
void load_optimizer_state(Run& run) {
  std::vector<ck::LoadTarget> targets =
      load_targets(ck::kOptimPrefix, run.engine->checkpoint_optimizer());
  // A parameter a frozen rule of the checkpoint's optim.param_groups matched has no state there:
  // unfrozen now, it starts fresh (compare_param_groups warned). The state of a parameter frozen
  // now is in the checkpoint and simply not read.
  const auto& saved = run.resume->metadata().tensors;
  targets.erase(std::remove_if(targets.begin(), targets.end(),
                               [&](const ck::LoadTarget& t) {
                                 if (saved.count(t.name)) return false;
                                 const std::string state =
                                     t.name.substr(std::string(ck::kOptimPrefix).size());
                                 const auto dot = state.rfind('.');
                                 return dot != std::string::npos &&
                                        frozen_in_checkpoint(run, state.substr(0, dot));
                               }),
                targets.end());
  run.resume->load(targets);
  run.engine->optimizer_state_loaded();
}

}  // namespace

void choose_resume(Run& run) {
  // Every rank chooses (train.resume=auto: `latest`, or the newest step that verifies when
  // `latest` is lost or names a broken step) and opens it; the ranks agree on the outcome and on
  // the step before any further collective.
  const std::string dir = (run.dir / "checkpoints").string();
  const std::optional<ck::ResumePoint> chosen = choose_resume_point(run, dir);
  const std::vector<int64_t> steps = comm::agree_on(
      *run.world_comm, run.device, "resume: choosing and opening the checkpoint", [&]() -> int64_t {
        if (!chosen) {
          if (run.cfg.train.resume == "auto")
            core::log::info("train.resume=auto: no checkpoint in {}, starting fresh", dir);
          return -1;
        }
        if (run.rank0) {
          for (const std::string& w : chosen->warnings) core::log::warn("{}", w);
        }
        run.resume = std::make_unique<ck::CheckpointReader>(chosen->path);
        run.resumed = true;
        run.start_step = run.resume->metadata().step;
        core::log::info("resuming from {} (step {}, saved with layout {})", chosen->path,
                        run.start_step, run.resume->metadata().layout.to_string());
        compare_config(run);
        return run.start_step;
      });
  if (std::any_of(steps.begin(), steps.end(), [&](int64_t t) { return t != steps[0]; })) {
    std::vector<std::string> seen;
    for (std::size_t r = 0; r < steps.size(); ++r) {
      seen.push_back(steps[r] < 0 ? fmt::format("rank {}: none", r)
                                  : fmt::format("rank {}: step {}", r, steps[r]));
    }
    throw_error<CheckpointError>(
        "resume: the ranks disagree on the checkpoint to resume from in '{}' ({}): every rank "
        "must see the same run directory (experiment.output_dir on a shared filesystem)",
        dir, core::join(seen, ", "));
  }
}

void with_config_hint(const Run& run, const std::vector<std::string>& prefixes,
                      const std::function<void()>& load) {
  try {
    load();
  } catch (const ck::ChecksumError&) {
    throw;  // corrupt bytes: no config key explains them
  } catch (const CheckpointError& e) {
    if (run.config_changes.empty()) throw;
    auto suspects = ck::changes_under(run.config_changes, prefixes);
    if (suspects.empty()) suspects = run.config_changes;
    throw_error<CheckpointError>("{}; config keys changed since the checkpoint was saved: {}",
                                 e.what(), ck::describe_changes(suspects));
  }
}

std::vector<parallel::StatePiece> checkpointed_model(const Run& run) {
  std::vector<parallel::StatePiece> pieces =
      run.engine ? run.engine->checkpoint_model(*run.model)
                 : parallel::checkpoint_module(*run.model, run.plan, run.tp);
  if (run.hooks.saves_model_tensor) {
    pieces.erase(std::remove_if(pieces.begin(), pieces.end(),
                                [&](const parallel::StatePiece& p) {
                                  return !run.hooks.saves_model_tensor(p.name);
                                }),
                 pieces.end());
  }
  return pieces;
}

void load_model_pieces(Run& run) {
  // This rank's flat range of every parameter (and the buffers, whole), from whatever shards of
  // whatever layout overlap them; or, before the engine exists, the module's tensors whole. Only
  // the tensors checkpoints hold (TrainerHooks::saves_model_tensor).
  run.resume->load(load_targets(ck::kModelPrefix, checkpointed_model(run)));
}

void load_fp8_histories(Run& run) {
  const auto& saved = run.resume->metadata().tensors;
  int loaded = 0;
  for (const auto& item : run.model->named_modules()) {
    auto* layer = dynamic_cast<kernels::fp8::Fp8LinearImpl*>(item.value().get());
    if (layer == nullptr || !layer->amax_history.defined()) continue;
    // The layer's own tensor "amax_history" under the model path "<layer>.fp8.": a checkpoint
    // saved under the current recipe has none, and the history starts empty (docs/training.md).
    ck::WeightsOptions o;
    o.prefix = std::string(ck::kModelPrefix) + item.key() + ".";
    if (!saved.count(o.prefix + "amax_history")) continue;
    ck::load_weights(*run.resume, *layer, o);
    ++loaded;
  }
  core::log::info("resume: {} FP8 amax histories read from '{}'", loaded, run.resume->dir());
}

void load_resumed_state(Run& run) {
  core::Stopwatch load_clock;
  const bool sharded_model = run.plan.shards_model();
  // Each rank reads its own pieces (ZeRO: its flat ranges; ZeRO-3 over several ranks: its shard of
  // the model too), which only it checks: the ranks agree on the outcome before any further
  // collective (agree_on), so a corrupt shard is one error on every rank, not a hang.
  comm::agree_on(
      *run.world_comm, run.device,
      fmt::format("resume from '{}': loading the {}optimizer state", run.resume->dir(),
                  sharded_model ? "model and " : ""),
      [&]() -> int64_t {
        if (sharded_model)
          with_config_hint(run, {"model.", "lora.", "qat."}, [&] { load_model_pieces(run); });
        with_config_hint(run, {"optim.", "model.", "lora.", "qat."},
                         [&] { load_optimizer_state(run); });
        check_resumed_state_finite(run);
        ck::load_loss_scaler(run.resume->metadata(), run.precision.scaler());
        if (run.hooks.load_extra) run.hooks.load_extra(*run.resume);
        // Last: everything above may have drawn random numbers.
        if (!ck::load_rng(*run.resume, run.world->rank())) {
          core::log::warn(
              "checkpoint has no RNG state for rank {} (saved with {} ranks): RNG reseeded",
              run.world->rank(), run.resume->metadata().world);
        }
        return 0;
      });
  // Every tensor of a replicated (DDP) checkpoint is read by every rank.
  int64_t bytes = 0;
  for (const auto& [name, info] : run.resume->metadata().tensors) bytes += info.nbytes();
  const double load_s = load_clock.elapsed_s();
  core::log::info("checkpoint loaded: {:.2f} GB in {:.2f} s on rank {} ({:.2f} GB/s)", bytes / 1e9,
                  load_s, run.world->rank(), bytes / 1e9 / load_s);
  run.resume.reset();
}

std::string nonfinite_loss_hint(const Run& run, int64_t step, const std::string& otherwise) {
  // The first step's loss is computed before any update: from the loaded weights alone.
  if (run.resumed || run.cfg.train.load_from.empty() || step != run.start_step + 1)
    return otherwise;
  return fmt::format(
      "no update has happened yet, so the weights loaded from train.load_from '{}' are the likely "
      "cause (finite values large enough to overflow in the forward pass); check that file or "
      "load other weights",
      run.cfg.train.load_from);
}

}  // namespace parallax::train::detail
