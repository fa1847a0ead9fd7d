// What parallel::parallelize() needs of a model (parallel/parallelize.h), defined in core, below
// both models/ and parallel/, so that the engines compose a model's parallelisms without including
// models/ (ARCHITECTURE §1). models::Model implements it; tests may implement it for a bare module.
#pragma once

#include "core/unit_hooks.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace parallax::core {

// The activation model (train/planner.h, docs/planning.md): what one sample's forward keeps for
// its backward, per unit of the chain, computed from the model's own shapes (nothing runs).
struct ActivationQuery {
  int compute_bytes = 4;  // bytes of the autocast dtype (bf16/fp16: 2); 4 without autocast
  bool fp8 = false;       // precision.mode=fp8: the ViT blocks' linears save FP8 inputs (1 byte)
  bool cuda = false;      // fused CUDA paths keep different tensors (e.g. bev sampling)
  int tp = 1;             // tensor-parallel ranks (the layers' shards)
  bool sequence_parallel = false;
};

// Activation checkpointing (train.activation_checkpointing), parsed once: none, selective (blocks
// 0, 2, 4, ... of the checkpointable blocks) or full (every block).
enum class Checkpointing { kNone, kSelective, kFull };
// "none" | "selective" | "full".
const char* to_string(Checkpointing mode);
// ConfigError naming train.activation_checkpointing for an unknown name.
Checkpointing parse_checkpointing(const std::string& name);
// Whether `mode` wraps checkpointable block `index` (0-based).
inline bool checkpointed_block(Checkpointing mode, int index) {
  return mode == Checkpointing::kFull || (mode == Checkpointing::kSelective && index % 2 == 0);
}

// The mean of a small float tensor over the data-parallel replicas (a loss's normalisers that
// count things in the batch); empty: this replica alone.
using ReplicaMean = std::function<at::Tensor(const at::Tensor&)>;

class ParallelModel {
 public:
  virtual ~ParallelModel() = default;

  // The model as a module (owned by a shared_ptr), which the engines hold.
  virtual std::shared_ptr<torch::nn::Module> as_module() = 0;
  // The ordered units; every trainable parameter is in exactly one (core/unit_hooks.h).
  virtual std::vector<Unit> units() const = 0;
  // Installs the hooks the model calls around each unit (nullptr: none). Not owned.
  virtual void set_unit_hooks(UnitHooks* hooks) = 0;
  // The forward as a chain of units() (0: the model cannot be cut into pipeline stages).
  virtual int chain_length() const = 0;
  // One positive cost per unit, what pipeline stages are balanced by.
  virtual std::vector<double> stage_costs() const = 0;
  // Bytes per sample each unit keeps from its forward to its backward under activation
  // checkpointing `mode`; empty: no activation model.
  virtual std::vector<double> saved_activations(const ActivationQuery& q, Checkpointing mode,
                                                std::vector<bool>* checkpointed) const = 0;
  // Wraps the blocks activation checkpointing `mode` selects (checkpointed_block), so each keeps
  // only its input and recomputes the rest in its backward; returns {wrapped, blocks}.
  virtual std::pair<int, int> apply_activation_checkpointing(Checkpointing mode) = 0;
};

}  // namespace parallax::core
