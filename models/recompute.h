// Activation recompute ("activation checkpointing"; named recompute in code so that it is never
// confused with the saved state of checkpoint/) for blocks of the model zoo.
//
// A RecomputableBlock is a module whose computation is one tensor in, one tensor out
// (`forward_impl`). With recompute on (set by parallel::parallelize() from the config key
// train.activation_checkpointing) and autograd recording, `forward` runs the block without saving
// its activations and recomputes it during backward: memory for activations drops to the block
// inputs, at the cost of one more forward per block.
//
// The recomputation replays the forward with the same RNG state (CPU and, for CUDA inputs, the
// device's generator) and the same autocast state, so dropout masks and dtypes match; gradients
// are identical to running without recompute. Parameter gradients are accumulated by a reentrant
// backward inside the block's backward, exactly once per backward, so DDP's gradient-ready hooks
// fire once per parameter.
//
// Contract: the block must outlive the backward of any forward it ran (the usual case: the model
// owns its blocks). Only the block input receives a gradient through the recompute boundary;
// other tensors the block reads must be its parameters or buffers.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

namespace parallax::models {

class RecomputableBlock : public torch::nn::Module {
 public:
  // The block's computation.
  virtual at::Tensor forward_impl(const at::Tensor& x) = 0;

  // forward_impl, recomputed in backward when enabled, in training mode and with grad recording
  // on.
  at::Tensor forward(const at::Tensor& x);

  void set_recompute(bool on) { recompute_ = on; }
  bool recompute() const { return recompute_; }

 private:
  bool recompute_ = false;
};

// Runs block->forward_impl(x) keeping only x, recomputed in backward (see the file comment).
at::Tensor run_recomputed(RecomputableBlock* block, const at::Tensor& x);

}  // namespace parallax::models
