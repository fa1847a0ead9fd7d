#include "parallel/engine.h"

#include "core/error.h"

#include <functional>

namespace parallax::parallel {

void Engine::forward_backward(int micro_steps, const std::function<at::Tensor(int)>& micro,
                              bool sync_buffers) {
  at::Tensor loss;
  forward_backward_split(micro_steps,
                         {[&](int i) { loss = micro(i); },
                          [&](int) {
                            at::Tensor l = std::move(loss);
                            l.backward();
                          }},
                         sync_buffers);
}

void add_terms(LossTerms& into, const LossTerms& from) {
  for (const auto& [k, v] : from) {
    auto it = into.find(k);
    if (it == into.end()) {
      into.emplace(k, v);
    } else {
      it->second = it->second + v;
    }
  }
}

std::vector<int> Engine::model_replicas() const {
  const comm::CommPtr dp = data_parallel_group();
  return dp ? dp->world_ranks() : std::vector<int>{};
}

units::ReplicaMean Engine::replica_mean() const {
  const comm::CommPtr dp = data_parallel_group();
  if (!dp || dp->size() <= 1) return {};
  const bool host = dp->device_type() == c10::kCPU;
  return [dp, host](const at::Tensor& t) {
    // A copy in fp32 on the group's device (the CPU backends reduce host tensors).
    at::Tensor x = t.detach()
                       .to(host ? c10::Device(c10::kCPU) : t.device(), at::kFloat,
                           /*non_blocking=*/false, /*copy=*/true)
                       .contiguous();
    const comm::WorkPtr w = dp->all_reduce_async(x, comm::ReduceOp::kAvg);
    w->wait_stream();
    return x.device() == t.device() ? x : x.to(t.device());
  };
}

std::vector<StatePiece> Engine::checkpoint_model(const torch::nn::Module& module) {
  std::vector<StatePiece> pieces = model_state();
  if (pieces.empty()) pieces = module_pieces(module, model_replicas());
  return global_pieces(std::move(pieces), tensor_parallel());
}

std::vector<StatePiece> Engine::checkpoint_optimizer() {
  return global_pieces(optimizer_state(), tensor_parallel());
}

const TensorParallelInfo& Engine::tensor_parallel() const {
  static const TensorParallelInfo kNone;
  return kNone;
}

void Engine::set_micro_batches(int micro_batches) {
  PARALLAX_CHECK(micro_batches >= 1, Error, "engine '{}': {} micro-batches per step", describe(),
                 micro_batches);
  micro_batches_ = micro_batches;
}

LossTerms Engine::step(const StepFns& fns, bool sync_buffers) {
  PARALLAX_CHECK(static_cast<bool>(fns.forward_loss), Error,
                 "engine '{}': step() needs StepFns::forward_loss (the whole model's forward)",
                 describe());
  LossTerms terms;
  forward_backward(
      micro_batches_,
      [&](int i) {
        MicroLoss l = fns.forward_loss(i);
        add_terms(terms, l.terms);
        return l.backprop;
      },
      sync_buffers);
  return terms;
}

}  // namespace parallax::parallel
