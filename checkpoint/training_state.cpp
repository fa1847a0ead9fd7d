#include "checkpoint/training_state.h"

#include "core/error.h"
#include "core/rng.h"

#include <ATen/ATen.h>

#include <map>

namespace parallax::checkpoint {

void add_module(SaveState& state, torch::nn::Module& module, const std::vector<int>& replicas,
                const std::string& prefix) {
  for (const auto& p : module.named_parameters(true)) {
    if (p.value().defined()) state.add_replicated(prefix + p.key(), p.value().detach(), replicas);
  }
  for (const auto& b : module.named_buffers(true)) {
    if (b.value().defined()) state.add_replicated(prefix + b.key(), b.value().detach(), replicas);
  }
}

void add_optimizer(SaveState& state, optim::Optimizer& optimizer, const std::vector<int>& replicas,
                   const std::string& prefix) {
  for (const auto& [key, t] : optimizer.state())
    state.add_replicated(prefix + key, t.detach(), replicas);
}

void add_rng(SaveState& state) {
  const core::RngState rng = core::capture_rng();
  state.add_rank_local("rng/cpu", rng.cpu);
  for (size_t i = 0; i < rng.cuda.size(); ++i)
    state.add_rank_local(fmt::format("rng/cuda/{}", i), rng.cuda[i]);
}

void add_loss_scaler(SaveState& state, const optim::LossScaler& scaler) {
  state.set_extra("loss_scaler.scale", scaler.scale());
  state.set_extra("loss_scaler.clean_steps", scaler.clean_steps());
  state.set_extra("loss_scaler.skipped_steps", scaler.skipped_steps());
}

void load_optimizer(CheckpointReader& reader, optim::Optimizer& optimizer,
                    const ReadOptions& options, const std::string& prefix) {
  std::vector<LoadTarget> targets;
  std::map<std::string, at::Tensor> live;
  for (auto& [key, t] : optimizer.state()) {
    at::Tensor dest = t;
    // "step" (and anything else returned by value) is a fresh tensor: read it, then hand it over.
    targets.push_back(LoadTarget{prefix + key, dest, {}});
    live.emplace(key, dest);
  }
  reader.load(targets, options);
  optimizer.load_state(
      live);  // copies each live tensor onto itself (a no-op) and sets the step count
}

bool load_rng(CheckpointReader& reader, int rank) {
  const std::string cpu = rank_local_name(rank, "rng/cpu");
  if (!reader.contains(cpu)) return false;
  core::RngState s;
  s.cpu = reader.read(cpu);
  for (int i = 0;; ++i) {
    const std::string n = rank_local_name(rank, fmt::format("rng/cuda/{}", i));
    if (!reader.contains(n)) break;
    s.cuda.push_back(reader.read(n));
  }
  core::restore_rng(s);
  return true;
}

bool load_loss_scaler(const Metadata& metadata, optim::LossScaler& scaler) {
  if (!metadata.has_extra("loss_scaler.scale")) return false;
  scaler.load(metadata.extra_double("loss_scaler.scale"),
              metadata.extra_int("loss_scaler.clean_steps"),
              metadata.extra_int("loss_scaler.skipped_steps"));
  return true;
}

}  // namespace parallax::checkpoint
