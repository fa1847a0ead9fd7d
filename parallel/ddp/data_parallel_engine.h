// What the two data-parallel engines, DDP (ddp_engine.h) and ZeRO (parallel/zero/zero.h), have in
// common, written once: the model module, the data-parallel group, the tensor parallelism they
// were built with, the optimizer they own and its state between optimizer_state() and
// optimizer_state_loaded(), and the gradient buckets that time their backward. Each engine adds
// only what its layout changes: how gradients are reduced and where they live, the update, and
// the geometry of its state pieces.
//
// Thread-safety and errors: those of Engine (parallel/engine.h).
#pragma once

#include "parallel/ddp/grad_buckets.h"
#include "parallel/engine.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace parallax::parallel::ddp {

class DataParallelEngine : public Engine {
 public:
  optim::Optimizer& optimizer() override { return *optimizer_; }
  comm::CommPtr data_parallel_group() const override { return dp_; }
  const TensorParallelInfo& tensor_parallel() const override { return tp_; }
  // Hands the pieces of the last optimizer_state() (views of the live state, now filled) back to
  // the optimizer, which sets its step count from them.
  void optimizer_state_loaded() override;
  // The timers of the gradient buckets (set_timed_buckets); none: not timed.
  StepTiming timing() const override;

 protected:
  // `dp` must not be null (one rank: no communication). `timing`: DdpOptions::timing.
  DataParallelEngine(std::shared_ptr<torch::nn::Module> module, comm::CommPtr dp,
                     TensorParallelInfo tp, bool timing);

  // The optimizer's state as it is now, kept until optimizer_state_loaded() (the pieces an
  // engine hands out are views of these tensors).
  const std::vector<std::pair<std::string, at::Tensor>>& hold_optimizer_state();
  // The gradient groups the optimizer steps on, split by tensor parallelism: the gradients of
  // tp-sharded parameters (by name) are pieces summed over tp, the others identical copies on every
  // tp rank. `dp_sharded`: every element lives in one dp rank's shard (ZeRO), else the dp ranks
  // hold identical averaged copies (DDP).
  std::vector<optim::GradGroup> grad_groups(
      const std::vector<std::pair<std::string, at::Tensor>>& named_grads, bool dp_sharded) const;
  // Engine::memory() from the tensors the engine holds: `params` and `grads` (each storage
  // counted once; undefined ones skipped) and the optimizer's moments and masters.
  EngineMemory measure(const std::vector<at::Tensor>& params,
                       const std::vector<at::Tensor>& grads) const;
  // The buckets whose backward and exposed-communication timers timing() reports (null: none,
  // e.g. DDP over one rank). Not owned.
  void set_timed_buckets(const GradBuckets* buckets) { timed_buckets_ = buckets; }

  std::shared_ptr<torch::nn::Module> module_;
  comm::CommPtr dp_;
  TensorParallelInfo tp_;
  bool timing_ = true;
  std::unique_ptr<optim::Optimizer> optimizer_;

 private:
  std::vector<std::pair<std::string, at::Tensor>> held_;  // the last optimizer_state()
  const GradBuckets* timed_buckets_ = nullptr;
};

}  // namespace parallax::parallel::ddp
