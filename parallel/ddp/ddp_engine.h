// The data-parallel engine of ZeRO stage 0: every rank holds the whole model and optimizer;
// gradients are all-reduced by DistributedDataParallel's buckets (ddp.h) in the last micro-step,
// the earlier ones accumulate locally (no-sync). With one data-parallel rank it is the plain
// single-process step (no DDP object, no communication). What it shares with ZeRO is in
// data_parallel_engine.h; its memory rule is parallel/memory_rules.h's ddp_memory_rule.
#pragma once

#include "parallel/ddp/data_parallel_engine.h"
#include "parallel/ddp/ddp.h"

namespace parallax::parallel::ddp {

class DdpEngine : public DataParallelEngine {
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
  // Whole tensors, replicated over the dp group.
  std::vector<StatePiece> optimizer_state() override;
  EngineMemory memory() override;

  DistributedDataParallel* ddp() { return ddp_.get(); }

 private:
  std::unique_ptr<DistributedDataParallel> ddp_;
};

}  // namespace parallax::parallel::ddp
