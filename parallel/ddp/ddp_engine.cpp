#include "parallel/ddp/ddp_engine.h"

#include <fmt/format.h>

#include <map>

namespace parallax::parallel::ddp {

DdpEngine::DdpEngine(std::shared_ptr<torch::nn::Module> module,
                     std::vector<optim::ParamGroup> groups, const OptimizerFactory& make,
                     comm::CommPtr dp, DdpOptions options, TensorParallelInfo tp)
    : module_(std::move(module)), dp_(std::move(dp)), timing_(options.timing), tp_(std::move(tp)) {
  // DDP first: its broadcast from rank 0 must precede the optimizer, whose fp32 masters of
  // low-precision parameters copy the values they see.
  if (dp_->size() > 1) ddp_ = std::make_unique<DistributedDataParallel>(module_, dp_, options);
  optimizer_ = make(std::move(groups));
}

std::string DdpEngine::describe() const {
  if (!ddp_) return "single process (no data-parallel communication)";
  return fmt::format("DDP over group '{}' of {} ranks: {} {} buckets", dp_->name(), dp_->size(),
                     ddp_->buckets().size(), to_string(ddp_->mode()));
}

void DdpEngine::broadcast_buffers() {
  if (ddp_) ddp_->before_forward();
}

void DdpEngine::forward_backward_split(int micro_steps, const MicroStepFns& fns,
                                       bool sync_buffers) {
  for (int i = 0; i < micro_steps; ++i) {
    if (ddp_) {
      // Gradients are reduced in the last micro-step only; the others accumulate locally.
      ddp_->set_require_sync(i == micro_steps - 1);
      if (sync_buffers) ddp_->before_forward();
    }
    fns.forward(i);
    if (ddp_) ddp_->before_backward();
    fns.backward(i);
    if (ddp_) ddp_->finalize_backward();
  }
}

std::vector<optim::GradGroup> DdpEngine::grads() {
  // After DDP's all-reduce every member holds the same averaged gradients: counted once. Under
  // tensor parallelism the tp-sharded gradients are pieces summed over tp, the others identical
  // copies on every tp rank.
  optim::GradGroup whole, sharded;
  for (const auto& item : module_->named_parameters()) {
    const at::Tensor& g = item.value().grad();
    if (!g.defined()) continue;
    (tp_.active() && tp_.is_sharded(item.key()) ? sharded : whole).grads.push_back(g);
  }
  for (auto* grp : {&whole, &sharded}) {
    if (dp_->size() > 1) grp->replicated_over.push_back(dp_.get());
  }
  if (!tp_.active()) return {std::move(whole)};
  whole.replicated_over.push_back(tp_.tp.get());
  sharded.sharded_over.push_back(tp_.tp.get());
  return {std::move(whole), std::move(sharded)};
}

void DdpEngine::update(double lr) {
  optimizer_->step(lr);
}

void DdpEngine::zero_grad() {
  optimizer_->zero_grad(/*set_to_none=*/true);
}

std::vector<StatePiece> DdpEngine::optimizer_state() {
  held_ = optimizer_->state();
  std::vector<StatePiece> out;
  const std::vector<int> replicas = dp_->world_ranks();
  for (auto& [key, t] : held_) {
    StatePiece piece;
    piece.name = key;
    piece.tensor = t.detach();
    piece.global_shape = t.sizes().vec();
    piece.offsets.assign(static_cast<std::size_t>(t.dim()), 0);
    piece.replicas = replicas;
    out.push_back(std::move(piece));
  }
  return out;
}

void DdpEngine::optimizer_state_loaded() {
  std::map<std::string, at::Tensor> live(held_.begin(), held_.end());
  optimizer_->load_state(live);  // the tensors are the live ones: sets the step count
  held_.clear();
}

EngineMemory DdpEngine::memory() {
  EngineMemory m;
  std::vector<at::Tensor> params, grads, state;
  for (const auto& p : module_->parameters()) {
    params.push_back(p);
    grads.push_back(p.grad());
  }
  for (const auto& [key, t] : optimizer_->state())
    if (key != "step" && t.dim() > 0) state.push_back(t);
  m.params = storage_bytes(params);
  m.grads = storage_bytes(grads);
  m.optimizer = storage_bytes(state);
  return m;
}

EngineMemory DdpEngine::memory_rule(const std::vector<ParamInfo>& params, const MemoryQuery& q) {
  constexpr int64_t kF32 = 4;
  int64_t all = 0, trainable = 0;
  for (const ParamInfo& p : params) {
    all += p.numel;
    if (p.trainable) trainable += p.numel;
  }
  EngineMemory m;
  m.params = all * kF32;
  m.grads = trainable * kF32;
  m.optimizer = static_cast<int64_t>(q.optimizer_bytes_per_element) * trainable;
  return m;
}

}  // namespace parallax::parallel::ddp
