// The pipeline-parallel engine (plan step 3, parallel/plan.h): each pipeline rank holds a
// contiguous run of the model's units per virtual stage, runs a checked global schedule
// (parallel/pipeline/schedule.h) over the step's micro-batches, and moves activations and their
// gradients point-to-point between neighbouring stages. Data parallelism (DDP or ZeRO-1/2) over the
// dp group of each stage is the inner engine, built on the stage's parameters only.
//
// Stages. partition() cuts the units; PipelineEngine freezes every parameter of the units this
// rank does not hold (requires_grad false, storage released), so the inner engine buckets and the
// optimizer steps on exactly the stage's parameters. gather_full_params() brings the others back
// (broadcast from their owners over the pp group) for evaluation and export.
//
// Messages. Each activation or gradient message is a header (int64[64]: a magic number, the
// producing stage, the micro-batch, the tensor count, each tensor's dtype and shape) and then the
// tensors, each with its own tag. The receiver checks the header against the plan: a stage or
// micro-batch mismatch, or a shape other than the one the gradient is for, is an error naming both
// stages (Megatron-LM PR #5271: a silent swap trained on the wrong activations). On a transport
// that matches messages by order (NCCL; PipelineOptions::ordered_p2p) every message has one tag
// and the receiver posts a header only when its consumer runs, in the order check_ordered() proves
// to be the sender's.
//
// Gradient reduction. Every op that produces parameter gradients (B, or W under zb) runs as one
// micro-step of the inner engine: the op's gradients G_p come from torch::autograd::grad, and the
// micro-step's loss is sum_p <p, G_p> over the stage's parameters (plus an empty slice of each
// other parameter of this rank), whose backward accumulates exactly G_p through the inner
// engine's hooks. So DDP and ZeRO-1 accumulate locally and reduce in the last micro-step, ZeRO-2
// reduce-scatters every micro-step, exactly as they do for gradient accumulation without a
// pipeline.
//
// Thread-safety: one training thread. Errors: parallax::Error / CommError / TimeoutError naming
// the stage, rank and micro-batch.
#pragma once

#include "parallel/engine.h"
#include "parallel/pipeline/schedule.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace parallax::parallel::pipeline {

// The stages' unit ranges: stage s runs units [bounds[s], bounds[s + 1]). `costs[u]`: unit u's
// cost (any positive measure); `explicit_counts` (parallel.pp_layout), when not empty, gives the
// number of units of each stage. Otherwise the split is contiguous and minimises the largest
// stage cost (the step's critical path); among the splits that reach that minimum, it takes the
// one whose largest activation footprint, in_flight[s] x the sum of `activation_bytes` over
// stage s's units, is smallest (when both are given: one value per unit, one per stage, e.g.
// Model::saved_activations and in_flight_per_stage: under 1F1B the first stage holds pp
// micro-batches and the last one, so heavy units move towards the end where that costs no time).
// ConfigError naming the keys and numbers: fewer units than stages, a layout of the wrong length,
// a stage of no units, counts that do not sum to the units.
std::vector<int> partition(const std::vector<double>& costs, int stages,
                           const std::vector<int>& explicit_counts = {},
                           const std::vector<double>& activation_bytes = {},
                           const std::vector<int>& in_flight = {});

using parallel::StageFns;

struct PipelineOptions {
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  std::vector<int> layout;  // units per stage; empty: balanced by unit cost
  // Activation bytes per unit (Model::saved_activations; any scale): the partition's second
  // criterion, weighted by the schedule's in-flight micro-batches per stage. Empty: costs only.
  std::vector<double> activation_bytes;
  // Receive every message in its sender's order, each with one tag: its header is posted when the
  // consumer runs rather than where the plan lists the receive (check_ordered() proves the plans
  // consume each peer's messages in its send order). NCCL matches point-to-point messages by
  // order, so the engine sets this itself on a device group; on CPU groups (MPI, gloo: matched by
  // tag) it is a test switch that runs the NCCL order through MPI's non-overtaking rule.
  bool ordered_p2p = false;
};

class PipelineEngine : public Engine {
 public:
  // `module`: the whole model (every rank builds it); `units`: its ordered units with `costs`;
  // `pp`: the pipeline group; `micro_batches`: per step. `make_inner` builds the data-parallel
  // engine on the module once the stage's parameters are the only trainable ones.
  PipelineEngine(std::shared_ptr<torch::nn::Module> module, std::vector<core::Unit> units,
                 const std::vector<double>& costs, comm::CommPtr pp, int micro_batches,
                 const PipelineOptions& options,
                 const std::function<std::unique_ptr<Engine>()>& make_inner);

  std::string describe() const override;
  void broadcast_buffers() override { inner_->broadcast_buffers(); }
  // Not available: a pipeline runs stages (forward_backward_stages).
  void forward_backward(int micro_steps, const std::function<at::Tensor(int)>& micro,
                        bool sync_buffers) override;
  bool pipelined() const override { return true; }
  void forward_backward_stages(int micro_steps, const StageFns& fns, bool sync_buffers) override;
  std::vector<optim::GradGroup> grads() override;
  void step(double lr) override { inner_->step(lr); }
  void zero_grad() override { inner_->zero_grad(); }
  optim::Optimizer& optimizer() override { return inner_->optimizer(); }
  std::vector<int> model_replicas() const override { return inner_->model_replicas(); }
  // The inner engine's, with the step counter replicated over every stage.
  std::vector<StatePiece> optimizer_state() override;
  void optimizer_state_loaded() override { inner_->optimizer_state_loaded(); }
  // The stage's parameters (whole, replicated over the dp group), and on pipeline rank 0 the
  // buffers (identical on every stage).
  std::vector<StatePiece> model_state() override;
  void gather_full_params() override;
  void release_full_params() override;
  EngineMemory memory() override { return inner_->memory(); }

  const Schedule& schedule() const { return schedule_; }
  // Units [first, last) of each global stage.
  const std::vector<int>& bounds() const { return bounds_; }
  // Compute time (forward, backward, weight passes) of this rank in the last step, ms: the bubble
  // measurement compares it with the step's wall time.
  double last_compute_ms() const { return compute_ms_; }

 private:
  struct Slot;  // one (micro-batch, stage)'s live tensors
  int tag(const Op& op, int k) const;
  bool ordered_ = false;  // PipelineOptions::ordered_p2p, or a device group
  // Where the pipeline communicator's buffers live: the model's device when it is of the
  // communicator's type (each rank's own GPU, cuda:local_rank), else the current device of that
  // type (World made it local_rank's), never a fixed index.
  c10::Device comm_device() const;

  std::shared_ptr<torch::nn::Module> module_;
  std::vector<core::Unit> units_;
  comm::CommPtr pp_;
  Schedule schedule_;
  std::vector<int> bounds_;
  std::vector<int> my_stages_;
  std::vector<std::string> stage_params_;                // trainable names of this rank's stages
  std::map<std::string, std::vector<int64_t>> foreign_;  // released parameters -> their shapes
  std::map<std::string, int> owner_;                     // parameter -> pipeline rank holding it
  std::unique_ptr<Engine> inner_;
  std::vector<int> step_replicas_;
  bool full_ = false;
  double compute_ms_ = 0;
};

}  // namespace parallax::parallel::pipeline
