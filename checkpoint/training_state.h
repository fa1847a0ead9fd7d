// The training state of a run as checkpoint entries, and back: the building blocks the trainer
// calls to save and resume (see docs/checkpoints.md for the full sequence).
//
// Names:
//   model/<module path>          parameters and buffers (checkpoint/weights.h loads them)
//   optim/<param path>.<state>   optimizer state (Optimizer::state(): exp_avg, exp_avg_sq, step,
//                                momentum_buffer, master), and optim/step
//   rank/<r>/rng/cpu             this rank's CPU generator state (uint8)
//   rank/<r>/rng/cuda/<i>        this rank's generator state of CUDA device i
//   extra: loss_scaler.scale, loss_scaler.clean_steps, loss_scaler.skipped_steps
// DDP: model and optimizer state are replicated on the dp group; pass its world ranks as
// `replicas` and each tensor is written once, by one member, the members sharing the bytes.
//
// Not thread-safe (the training thread). Errors: CheckpointError naming the tensor.
#pragma once

#include "checkpoint/reader.h"
#include "checkpoint/save_state.h"
#include "optim/grad_utils.h"
#include "optim/optimizer.h"

#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace parallax::checkpoint {

inline constexpr const char* kOptimPrefix = "optim/";

// Parameters and buffers of `module` as "<prefix><module path>", replicated on `replicas` (world
// ranks; empty: every rank).
void add_module(SaveState& state, torch::nn::Module& module, const std::vector<int>& replicas = {},
                const std::string& prefix = "model/");
// Optimizer::state() as "<prefix><key>", replicated on `replicas`.
void add_optimizer(SaveState& state, optim::Optimizer& optimizer,
                   const std::vector<int>& replicas = {}, const std::string& prefix = kOptimPrefix);
// This rank's CPU and CUDA generator states (core::capture_rng) as rank-local entries.
void add_rng(SaveState& state);
void add_loss_scaler(SaveState& state, const optim::LossScaler& scaler);

// Restores the optimizer's state in place (read straight into its state tensors, no second copy
// of the state in memory). Every key of Optimizer::state() must be present.
void load_optimizer(CheckpointReader& reader, optim::Optimizer& optimizer,
                    const ReadOptions& options = {}, const std::string& prefix = kOptimPrefix);
// Restores this rank's generators from rank/<rank>/rng/*. Returns false (and changes nothing)
// when the checkpoint holds no RNG state for `rank` (e.g. it was saved with fewer ranks).
bool load_rng(CheckpointReader& reader, int rank);
// Restores the loss scaler from extra; returns false when the checkpoint has no scaler state.
bool load_loss_scaler(const Metadata& metadata, optim::LossScaler& scaler);

}  // namespace parallax::checkpoint
