#include "parallel/ddp/data_parallel_engine.h"

#include "core/error.h"

#include <map>

namespace parallax::parallel::ddp {

DataParallelEngine::DataParallelEngine(std::shared_ptr<torch::nn::Module> module, comm::CommPtr dp,
                                       TensorParallelInfo tp, bool timing)
    : module_(std::move(module)), dp_(std::move(dp)), tp_(std::move(tp)), timing_(timing) {
  PARALLAX_CHECK(dp_ != nullptr, Error, "data-parallel engine: the data-parallel group is null");
}

void DataParallelEngine::optimizer_state_loaded() {
  std::map<std::string, at::Tensor> live(held_.begin(), held_.end());
  optimizer_->load_state(live);  // the tensors are the live ones: sets the step count
  held_.clear();
}

StepTiming DataParallelEngine::timing() const {
  if (timed_buckets_ == nullptr) return {};
  return {timing_, timed_buckets_->last_backward_ms(), timed_buckets_->last_exposed_comm_ms()};
}

const std::vector<std::pair<std::string, at::Tensor>>& DataParallelEngine::hold_optimizer_state() {
  held_ = optimizer_->state();
  return held_;
}

std::vector<optim::GradGroup> DataParallelEngine::grad_groups(
    const std::vector<std::pair<std::string, at::Tensor>>& named_grads, bool dp_sharded) const {
  optim::GradGroup whole, sharded;
  for (const auto& [name, g] : named_grads)
    (tp_.active() && tp_.is_sharded(name) ? sharded : whole).grads.push_back(g);
  for (auto* grp : {&whole, &sharded}) {
    if (dp_sharded) {
      grp->sharded_over.push_back(dp_.get());
    } else if (dp_->size() > 1) {
      grp->replicated_over.push_back(dp_.get());
    }
  }
  if (!tp_.active()) return {std::move(whole)};
  whole.replicated_over.push_back(tp_.tp.get());
  sharded.sharded_over.push_back(tp_.tp.get());
  return {std::move(whole), std::move(sharded)};
}

EngineMemory DataParallelEngine::measure(const std::vector<at::Tensor>& params,
                                         const std::vector<at::Tensor>& grads) const {
  std::vector<at::Tensor> state;
  for (const auto& [key, t] : optimizer_->state())
    if (key != "step" && t.dim() > 0) state.push_back(t);
  EngineMemory m;
  m.params = storage_bytes(params);
  m.grads = storage_bytes(grads);
  m.optimizer = storage_bytes(state);
  return m;
}

}  // namespace parallax::parallel::ddp
