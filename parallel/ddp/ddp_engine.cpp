#include "parallel/ddp/ddp_engine.h"

#include <fmt/format.h>

#include <utility>

namespace parallax::parallel::ddp {

DdpEngine::DdpEngine(std::shared_ptr<torch::nn::Module> module,
                     std::vector<optim::ParamGroup> groups, const OptimizerFactory& make,
                     comm::CommPtr dp, DdpOptions options, TensorParallelInfo tp)
    : DataParallelEngine(std::move(module), std::move(dp), std::move(tp), options.timing) {
  // DDP first: its broadcast from rank 0 must precede the optimizer, whose fp32 masters of
  // low-precision parameters copy the values they see.
  if (dp_->size() > 1) ddp_ = std::make_unique<DistributedDataParallel>(module_, dp_, options);
  set_timed_buckets(ddp_.get());
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
  // After DDP's all-reduce every member holds the same averaged gradients: counted once.
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& item : module_->named_parameters()) {
    const at::Tensor& g = item.value().grad();
    if (g.defined()) named.emplace_back(item.key(), g);
  }
  return grad_groups(named, /*dp_sharded=*/false);
}

void DdpEngine::update(double lr) {
  optimizer_->step(lr);
}

void DdpEngine::zero_grad() {
  optimizer_->zero_grad(/*set_to_none=*/true);
}

std::vector<StatePiece> DdpEngine::optimizer_state() {
  std::vector<StatePiece> out;
  const std::vector<int> replicas = dp_->world_ranks();
  for (const auto& [key, t] : hold_optimizer_state()) {
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

EngineMemory DdpEngine::memory() {
  std::vector<at::Tensor> params, grads;
  for (const auto& p : module_->parameters()) {
    params.push_back(p);
    grads.push_back(p.grad());
  }
  return measure(params, grads);
}

}  // namespace parallax::parallel::ddp
