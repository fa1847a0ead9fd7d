// Gradient utilities that must be correct across parallel groups: global-norm clipping and the
// dynamic loss scaler of fp16 training.
//
// Both take the gradients this rank holds and the communicators over which those gradients are
// *sharded* (ZeRO, TP, PP). Replicated gradients (plain DDP after its all-reduce) need no
// communicator: every rank already holds the full, identical set.
#pragma once

#include "comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <vector>

namespace parallax::optim {

// Gradients as a parallel engine holds them (parallel/engine.h): `grads` are this rank's tensors;
// the members of each communicator in `sharded_over` hold disjoint pieces of the same logical
// gradients (ZeRO over dp, TP shards over tp, PP stages over pp), so their squares are summed over
// those groups; the members of each communicator in `replicated_over` hold identical copies (DDP
// after its all-reduce), which are counted once. Every element of the model's gradient is then
// counted exactly once in the global norm, in any layout.
struct GradGroup {
  std::vector<at::Tensor> grads;
  std::vector<comm::Communicator*> sharded_over;
  std::vector<comm::Communicator*> replicated_over;
};

// The global L2 norm over every group (each group's sum of squares all-reduced over its
// sharded_over communicators, in a rank-independent order), then clipping as below. Collective
// over the sharded_over groups.
at::Tensor clip_grad_norm(const std::vector<GradGroup>& groups, double max_norm);

// Global L2 norm of `grads` (fp32 accumulation) summed over the shards held by the members of
// each communicator in `shard_groups`; then scales every gradient by min(1, max_norm / (norm +
// 1e-6)) in place when max_norm > 0. Returns the norm as a 0-d fp32 tensor on the grads' device
// (no host synchronisation: read it only when logging). Non-finite norms leave grads untouched.
at::Tensor clip_grad_norm(const std::vector<at::Tensor>& grads, double max_norm,
                          const std::vector<comm::Communicator*>& shard_groups = {});

// Dynamic loss scaling for fp16 (the policy of torch.cuda.amp.GradScaler / Megatron):
// start at `init_scale`; every step, unscale the grads and check them for inf/NaN (on every rank
// of the shard groups); on overflow skip the optimizer step and halve the scale; after
// `growth_interval` consecutive clean steps double it. If the scale would fall below `min_scale`,
// throw NumericsError: training has diverged and continuing would only waste the allocation.
// A disabled scaler (bf16/fp32) scales by 1 and never skips.
class LossScaler {
 public:
  LossScaler(bool enabled, double init_scale = 65536.0, int64_t growth_interval = 2000,
             double min_scale = 1.0);

  bool enabled() const { return enabled_; }
  double scale() const { return scale_; }
  int64_t skipped_steps() const { return skipped_; }
  int64_t clean_steps() const { return clean_; }

  at::Tensor scale_loss(const at::Tensor& loss) const;
  // Divides `grads` by the scale in place and returns true if any rank found inf/NaN.
  // The one host synchronisation of an fp16 step (the skip decision).
  bool unscale_and_check(const std::vector<at::Tensor>& grads,
                         const std::vector<comm::Communicator*>& shard_groups = {});
  // The same over an engine's gradient groups: the skip decision is agreed over every
  // sharded_over communicator of any group (replicated copies agree by construction).
  bool unscale_and_check(const std::vector<GradGroup>& groups);
  // Updates the scale after a step: `found_inf` from unscale_and_check.
  void update(bool found_inf);

  // Checkpointing.
  void load(double scale, int64_t clean_steps, int64_t skipped_steps);

 private:
  bool enabled_;
  double scale_;
  int64_t growth_interval_;
  double min_scale_;
  int64_t clean_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace parallax::optim
