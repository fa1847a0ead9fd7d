// What parallel::parallelize() needs of a model (parallel/parallelize.h): its units, its chain,
// its costs, its activation model and activation recompute. The units layer sits below both
// models/ and parallel/, so the engines compose a model's parallelisms without including models/
// (ARCHITECTURE §1). models::Model implements it; tests may implement it for a bare module.
#pragma once

#include "units/unit_hooks.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace parallax::units {

// The activation model (train/planner.h, docs/planning.md): what one sample's forward keeps for
// its backward, per unit of the chain, computed from the model's own shapes (nothing runs).
struct ActivationQuery {
  int compute_bytes = 4;  // bytes of the autocast dtype (bf16/fp16: 2); 4 without autocast
  bool fp8 = false;       // precision.mode=fp8: the ViT blocks' linears save FP8 inputs (1 byte)
  bool cuda = false;      // fused CUDA paths keep different tensors (e.g. bev sampling)
  int tp = 1;             // tensor-parallel ranks (the layers' shards)
  bool sequence_parallel = false;
};

// Activation recompute ("activation checkpointing" in the literature and in the config key
// train.activation_checkpointing; named recompute in code so that it is never confused with the
// saved state of checkpoint/), parsed once: none, selective (blocks 0, 2, 4, ... of the
// recomputable blocks) or full (every block).
enum class Recompute { kNone, kSelective, kFull };
// "none" | "selective" | "full".
const char* to_string(Recompute mode);
// ConfigError naming train.activation_checkpointing for an unknown name.
Recompute parse_recompute(const std::string& name);
// Whether `mode` wraps recomputable block `index` (0-based).
inline bool recomputed_block(Recompute mode, int index) {
  return mode == Recompute::kFull || (mode == Recompute::kSelective && index % 2 == 0);
}

// The mean of a small float tensor over the data-parallel replicas (a loss's normalisers that
// count things in the batch); empty: this replica alone.
using ReplicaMean = std::function<at::Tensor(const at::Tensor&)>;

class ParallelModel {
 public:
  virtual ~ParallelModel() = default;

  // The model as a module (owned by a shared_ptr), which the engines hold.
  virtual std::shared_ptr<torch::nn::Module> as_module() = 0;
  // The ordered units; every trainable parameter is in exactly one (units/unit_hooks.h).
  virtual std::vector<Unit> units() const = 0;
  // Installs the hooks the model calls around each unit (nullptr: none). Not owned.
  virtual void set_unit_hooks(UnitHooks* hooks) = 0;
  // The forward as a chain of units() (0: the model cannot be cut into pipeline stages).
  virtual int chain_length() const = 0;
  // One positive cost per unit, what pipeline stages are balanced by.
  virtual std::vector<double> stage_costs() const = 0;
  // Bytes per sample each unit keeps from its forward to its backward under activation recompute
  // `mode`; `recomputed`, if given, receives which units are recomputed. Empty: no activation
  // model.
  virtual std::vector<double> saved_activations(const ActivationQuery& q, Recompute mode,
                                                std::vector<bool>* recomputed) const = 0;
  // Wraps the blocks activation recompute `mode` selects (recomputed_block), so each keeps only
  // its input and recomputes the rest in its backward; returns {wrapped, blocks}.
  virtual std::pair<int, int> apply_recompute(Recompute mode) = 0;
};

}  // namespace parallax::units
