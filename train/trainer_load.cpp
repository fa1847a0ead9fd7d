// The trainer's sources of weights (train/trainer_impl.h has the class): which checkpoint a resume
// trusts, its shards' checksums verified under train.resume=auto, and what a non-finite first loss
// says about the weights of train.load_from.
#include "checkpoint/checksum_error.h"
#include "train/trainer_impl.h"

namespace parallax::train::detail {

std::optional<ck::ResumePoint> TrainerImpl::choose_resume_point(
    const std::string& checkpoints_dir) {
  // Steps whose shards failed verification, with the problem: skipped by the next choice and named
  // in its warning, as a truncated or missing shard is.
  std::map<int64_t, std::string> corrupt;
  while (true) {
    std::optional<ck::ResumePoint> point;
    const std::vector<int64_t> steps =
        comm::agree_on(*world_comm_, device_, "resume: choosing the checkpoint", [&]() -> int64_t {
          point = ck::find_resume_point(cfg_.train.resume, checkpoints_dir, corrupt);
          return point ? point->step : -1;
        });
    // Ranks that chose differently (no shared filesystem) verify nothing: setup refuses them. An
    // explicit checkpoint has no fallback: its shards are verified as they load.
    const bool agreed =
        std::all_of(steps.begin(), steps.end(), [&](int64_t s) { return s == steps.front(); });
    if (agreed && point && cfg_.train.resume == "auto") {
      try {
        // The ranks share the reading (rank r: the rank files r, r + world, ...), so a resume
        // reads the checkpoint once more in all, not once more per rank.
        comm::agree_on(*world_comm_, device_,
                       fmt::format("resume: verifying the checksums of '{}'", point->path),
                       [&]() -> int64_t {
                         core::Stopwatch clock;
                         const int64_t bytes =
                             ck::verify_checkpoint_part(point->path, world_.rank(), world_.size());
                         core::log::info("resume: {} of '{}' verified in {:.2f} s on rank {}",
                                         core::human_bytes(static_cast<double>(bytes)), point->path,
                                         clock.elapsed_s(), world_.rank());
                         return 0;
                       });
      } catch (const CheckpointError& e) {
        // The same error on every rank (agree_on): each one drops this step alike.
        corrupt[point->step] = e.what();
        continue;
      }
    }
    if (point && !cfg_.train.load_from.empty() && !hooks_.saves_model_tensor && rank0_) {
      // torchtitan and mmengine do the same: a job that starts from pretrained weights and is
      // resubmitted with train.resume=auto continues its own training.
      core::log::warn(
          "train.load_from '{}' is ignored: the run resumes from '{}' (step {}), which holds the "
          "trained model (train.resume wins; train.resume='' starts from train.load_from)",
          cfg_.train.load_from, point->path, point->step);
    }
    return point;
  }
}

std::string TrainerImpl::nonfinite_loss_hint(int64_t step, const std::string& otherwise) const {
  // The first step's loss is computed before any update: from the loaded weights alone.
  if (resumed_ || cfg_.train.load_from.empty() || step != start_step_ + 1) return otherwise;
  return fmt::format(
      "no update has happened yet, so the weights loaded from train.load_from '{}' are the likely "
      "cause (finite values large enough to overflow in the forward pass); check that file or "
      "load other weights",
      cfg_.train.load_from);
}

}  // namespace parallax::train::detail
