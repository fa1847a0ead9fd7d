// The data-parallel engine of ZeRO stage 0: every rank holds the whole model and optimizer;
// gradients are all-reduced by DistributedDataParallel's buckets (ddp.h) in the last micro-step,
// the earlier ones accumulate locally (no-sync). With one data-parallel rank it is the plain
// single-process step (no DDP object, no communication).
#pragma once

#include "parallel/ddp/ddp.h"
#include "parallel/engine.h"

namespace parallax::parallel::ddp {

class DdpEngine : public Engine {
 public:
  // Wraps `module` in DDP over `dp` when dp has more than one rank (broadcasting parameters and
  // buffers from its rank 0 first), then builds the optimizer over `groups` with `make`.
  DdpEngine(std::shared_ptr<torch::nn::Module> module, std::vector<optim::ParamGroup> groups,
            const OptimizerFactory& make, comm::CommPtr dp, DdpOptions options,
            TensorParallelInfo tp = {});

  std::string describe() const override;
  void broadcast_buffers() override;
  void forward_backward_split(int micro_steps, const MicroStepFns& fns, bool sync_buffers) override;
  std::vector<optim::GradGroup> grads() override;
  void update(double lr) override;
  void zero_grad() override;
  optim::Optimizer& optimizer() override { return *optimizer_; }
  std::vector<int> model_replicas() const override { return dp_->world_ranks(); }
  comm::CommPtr data_parallel_group() const override { return dp_; }
  const TensorParallelInfo& tensor_parallel() const override { return tp_; }
  std::vector<StatePiece> optimizer_state() override;
  void optimizer_state_loaded() override;
  EngineMemory memory() override;
  // What memory() measures after a step, predicted for fp32 `params` (parallel/build_engine.h:
  // predicted_memory): every parameter whole, a gradient per trainable one (autograd's, or DDP's
  // flat buckets, which hold exactly the parameters), the optimizer state per trainable element.
  static EngineMemory memory_rule(const std::vector<ParamInfo>& params, const MemoryQuery& q);
  double last_backward_ms() const override { return ddp_ ? ddp_->last_backward_ms() : 0; }
  double last_exposed_comm_ms() const override { return ddp_ ? ddp_->last_exposed_comm_ms() : 0; }
  bool timed() const override { return ddp_ != nullptr && timing_; }

  DistributedDataParallel* ddp() { return ddp_.get(); }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  comm::CommPtr dp_;
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::vector<std::pair<std::string, at::Tensor>> held_;  // the last optimizer_state()
  bool timing_ = true;
  TensorParallelInfo tp_;
};

}  // namespace parallax::parallel::ddp
