// The trainer's checkpoints: save, load on resume, config comparison (train/trainer_impl.h has the
// class).
#include "checkpoint/checksum_error.h"
#include "train/trainer_impl.h"

namespace parallax::train::detail {

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

}  // namespace

void TrainerImpl::compare_config(const std::string& config_text) {
  const std::string where = resume_->dir();
  const std::optional<std::string> saved = resume_->config_text();
  if (!saved) {
    // Saved before checkpoints kept their config: only the hash can tell.
    if (rank0_ && resume_->metadata().config_hash != core::stable_hash(config_text)) {
      core::log::warn(
          "resuming from {} (step {}): its config hash differs from this run's, and it was saved "
          "without its config, so the changed keys are unknown",
          where, start_step_);
    }
    return;
  }
  // train.resume is how a resume is asked for: it differs by nature.
  config_changes_ =
      ck::diff_configs(*saved, config_text, {"train.resume"},
                       fmt::format("'{}/{}'", where, ck::kConfigFile), "this run's config");
  if (rank0_ && !config_changes_.empty()) {
    core::log::warn(
        "resuming from step {} with a config that differs from the checkpoint's ({}/{}): {}",
        start_step_, where, ck::kConfigFile, ck::describe_changes(config_changes_));
  }
}

void TrainerImpl::with_config_hint(const std::vector<std::string>& prefixes,
                                   const std::function<void()>& load) const {
  try {
    load();
  } catch (const ck::ChecksumError&) {
    throw;  // corrupt bytes: no config key explains them
  } catch (const CheckpointError& e) {
    if (config_changes_.empty()) throw;
    auto suspects = ck::changes_under(config_changes_, prefixes);
    if (suspects.empty()) suspects = config_changes_;
    throw_error<CheckpointError>("{}; config keys changed since the checkpoint was saved: {}",
                                 e.what(), ck::describe_changes(suspects));
  }
}

void TrainerImpl::check_resumed_state_finite() const {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& piece : engine_->checkpoint_model(*model_))
    state.emplace_back("model/" + piece.name, piece.tensor);
  for (const auto& [k, t] : engine_->optimizer().state()) state.emplace_back("optim/" + k, t);
  std::vector<at::Tensor> tensors;
  for (const auto& [k, t] : state) tensors.push_back(t.detach());
  const int64_t bad = ck::first_nonfinite(tensors, /*parallel=*/true);
  if (bad < 0) return;
  const auto count = ck::count_nonfinite(tensors[static_cast<std::size_t>(bad)]);
  throw_error<CheckpointError>(
      "checkpoint '{}' (step {}): tensor '{}' holds {} NaN and {} infinite value(s); "
      "resume from an earlier checkpoint (train.resume=<its path>)",
      resume_->dir(), start_step_, state[static_cast<std::size_t>(bad)].first, count.nan,
      count.inf);
}

void TrainerImpl::load_model_pieces() {
  // This rank's flat range of every parameter (and the buffers, whole), from whatever shards of
  // whatever layout overlap them; or, before the engine exists, the module's tensors whole. Only
  // the tensors checkpoints hold (TrainerHooks::saves_model_tensor).
  resume_->load(load_targets(ck::kModelPrefix, checkpointed_model()));
}

std::vector<parallel::StatePiece> TrainerImpl::checkpointed_model() const {
  std::vector<parallel::StatePiece> pieces = engine_
                                                 ? engine_->checkpoint_model(*model_)
                                                 : parallel::checkpoint_module(*model_, plan_, tp_);
  if (hooks_.saves_model_tensor) {
    pieces.erase(std::remove_if(pieces.begin(), pieces.end(),
                                [&](const parallel::StatePiece& p) {
                                  return !hooks_.saves_model_tensor(p.name);
                                }),
                 pieces.end());
  }
  return pieces;
}

void TrainerImpl::load_optimizer_state() {
  // Each rank reads exactly the pieces it holds (a ZeRO rank: one flat range of each state tensor,
  // read as the boxes it covers), from whatever shards of whatever layout overlap them.
  resume_->load(load_targets(ck::kOptimPrefix, engine_->checkpoint_optimizer()));
  engine_->optimizer_state_loaded();
}

void TrainerImpl::save_checkpoint(int64_t step) {
  if (!checkpointer_) return;
  // Rows of steps <= `step` reach the disk before this checkpoint can commit (and, async, before
  // the background commit starts): a run resumed from it finds every one of them (metrics.h).
  metrics_->sync();
  ck::SaveState state;
  // The model: whole and replicated, or (ZeRO-3) each rank's flat range of every parameter; only
  // the tensors the hooks keep (LoRA: the adapters).
  const int64_t model_bytes = add_pieces(state, ck::kModelPrefix, checkpointed_model());
  if (hooks_.saves_model_tensor && !model_tensors_logged_) {
    core::log::info(
        "checkpoints hold {} of model tensors on this rank (what trains; the rest comes from the "
        "base)",
        core::human_bytes(static_cast<double>(model_bytes)));
    model_tensors_logged_ = true;
  }
  // The optimizer state per parameter under its global name and shape, as the engine holds it
  // (whole and replicated under DDP; one flat range of each parameter's state under ZeRO).
  add_pieces(state, ck::kOptimPrefix, engine_->checkpoint_optimizer());
  ck::add_rng(state);
  ck::add_loss_scaler(state, *scaler_);
  if (hooks_.save_extra) hooks_.save_extra(state);
  const auto pos = source_->position();
  state.set_extra("data.epoch", pos.first);
  state.set_extra("data.position", pos.second);
  checkpointer_->save(step, state);
  if (const auto st = checkpointer_->last_save(); st && st->step == step) {
    core::log::info("checkpoint step {} committed: {} ({:.2f} s)", step, st->path, st->total_s);
  } else {
    core::log::info("checkpoint step {}: writing in the background", step);
  }
}

}  // namespace parallax::train::detail
