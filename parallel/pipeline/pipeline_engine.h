// The pipeline-parallel engine (plan step 3, parallel/parallelize.h): each pipeline rank holds a
// contiguous run of the model's units per virtual stage, runs a checked global schedule
// (parallel/pipeline/schedule.h) over the step's micro-batches, and moves activations and their
// gradients point-to-point between neighbouring stages. Data parallelism (DDP or ZeRO-1/2) over the
// dp group of each stage is the inner engine, built on the stage's parameters only.
//
// The engine is the interpreter of a checked plan: it builds the plan (schedule.h), checks it
// (schedule_check.h), cuts the units (partition.h), learns the messages' shapes once
// (shape_pass.h), and then runs each op of this rank's plan in order: compute ops itself, and
// communication through the p2p messenger (p2p.h: message format, tags, one batched call per plan
// slot, error context). The step's number of micro-batches enters once, at construction
// (`micro_batches`, train.grad_accum): the plan is built for it and the partition weighs the
// activations it keeps in flight; step() checks the count it is given against the plan.
//
// Stages. partition() cuts the units; PipelineEngine freezes every parameter of the units this
// rank does not hold (requires_grad false, storage released), so the inner engine buckets and the
// optimizer steps on exactly the stage's parameters. gather_full_params() brings the others back
// (broadcast from their owners over the pp group) for evaluation and export.
//
// Gradient reduction. Every op that produces parameter gradients (B, or W under zb) runs as one
// micro-step of the inner engine (Engine::forward_backward_split): B is
// torch::autograd::backward(outputs, received gradients) (the last stage: from its loss), which
// accumulates the stage's parameter gradients and its inputs' through the inner engine's hooks.
// So DDP and ZeRO-1 accumulate locally and reduce in the last micro-step, ZeRO-2 reduce-scatters
// every micro-step, exactly as they do for gradient accumulation without a pipeline. Under zb, B
// computes the inputs' gradients only and keeps what the weight pass needs, and W accumulates the
// parameters' (split_backward.h): each part of the graph runs once.
//
// Thread-safety: one training thread. Errors: parallax::Error / CommError / TimeoutError naming
// the stage, rank and micro-batch.
#pragma once

#include "parallel/engine.h"
#include "parallel/pipeline/p2p.h"
#include "parallel/pipeline/schedule.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace parallax::parallel::pipeline {

// What one pipeline stage computes (the chain part of StepFns, with the loss to backpropagate).
struct StageFns {
  // The first stage: what unit 0 takes for micro-batch `micro`.
  std::function<std::vector<at::Tensor>(int micro)> begin;
  // Units [first, last) of micro-batch `micro` on `in` (side inputs from the micro-batch).
  std::function<std::vector<at::Tensor>(int micro, int first, int last,
                                        const std::vector<at::Tensor>& in)>
      run;
  // The last stage: the (scaled) loss to backpropagate from the last unit's outputs.
  std::function<at::Tensor(int micro, const std::vector<at::Tensor>& out)> finish;
};

struct PipelineOptions {
  ScheduleKind schedule = ScheduleKind::k1F1B;
  int virtual_stages = 1;
  std::vector<int> layout;  // units per stage; empty: balanced by unit cost
  // Activation bytes per unit (Model::saved_activations; any scale): the partition's second
  // criterion, weighted by the schedule's in-flight micro-batches per stage. Empty: costs only.
  std::vector<double> activation_bytes;
  // Match messages by their order, each with one tag, and post each slot's sends and receives as
  // one batch (check_posting_order() proves both ends post each pair's messages in one order).
  // NCCL matches point-to-point messages by order, so the engine sets this itself on a device
  // group; on CPU groups (MPI, gloo: matched by tag) it is a test switch that runs the NCCL order
  // through MPI's non-overtaking rule.
  bool ordered_p2p = false;
};

class PipelineEngine : public Engine {
 public:
  // `module`: the whole model (every rank builds it); `units`: its ordered units with `costs`;
  // `pp`: the pipeline group; `micro_batches`: per step (train.grad_accum), the one place the
  // engine learns it. `make_inner` builds the data-parallel engine on the module once the stage's
  // parameters are the only trainable ones.
  PipelineEngine(std::shared_ptr<torch::nn::Module> module, std::vector<units::Unit> units,
                 const std::vector<double>& costs, comm::CommPtr pp, int micro_batches,
                 const PipelineOptions& options,
                 const std::function<std::unique_ptr<Engine>()>& make_inner);

  std::string describe() const override;
  void broadcast_buffers() override { inner_->broadcast_buffers(); }
  // The schedule over the chain part of `fns` (begin / run / finish); then the loss terms, which
  // only the last stage computes, go from it to every stage (broadcast over the pipeline group:
  // the names once, the values each step), so every rank logs and checks the same loss.
  // Runs the plan, built for the constructor's `micro_batches`.
  LossTerms step(const StepFns& fns, bool sync_buffers) override;
  // The schedule alone, over the constructor's micro-batches, on stage functions whose finish()
  // gives the loss to backpropagate (step() runs this; tests and benchmarks call it directly).
  void forward_backward_stages(const StageFns& fns, bool sync_buffers);
  // Not available: a pipeline runs stages (step()).
  void forward_backward(int micro_steps, const std::function<at::Tensor(int)>& micro,
                        bool sync_buffers) override;
  void forward_backward_split(int micro_steps, const MicroStepFns& fns, bool sync_buffers) override;
  std::vector<optim::GradGroup> grads() override;
  void update(double lr) override { inner_->update(lr); }
  void zero_grad() override { inner_->zero_grad(); }
  optim::Optimizer& optimizer() override { return inner_->optimizer(); }
  comm::CommPtr data_parallel_group() const override { return inner_->data_parallel_group(); }
  const TensorParallelInfo& tensor_parallel() const override { return inner_->tensor_parallel(); }
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
  struct Slot;    // one (micro-batch, stage)'s live tensors (pipeline_engine.cpp)
  class StepRun;  // one step's run of the plan (pipeline_engine.cpp)
  // Where the pipeline communicator's buffers live: the model's device when it is of the
  // communicator's type (each rank's own GPU, cuda:local_rank), else the current device of that
  // type (World made it local_rank's), never a fixed index.
  c10::Device comm_device() const;
  // The device of the stage's parameters (the first with storage; the CPU if none).
  c10::Device model_device() const;
  // Freezes and releases the parameters of other ranks' stages; notes this rank's and the owners.
  void release_foreign_params();
  // The optimizer's step counter's replicas: every stage's data-parallel ranks.
  void gather_step_replicas();
  // step(): the loss terms' names, sent once by the last stage.
  void sync_terms(LossTerms& terms);

  std::shared_ptr<torch::nn::Module> module_;
  std::vector<units::Unit> units_;
  comm::CommPtr pp_;
  Schedule schedule_;
  std::vector<int> bounds_;
  std::vector<int> my_stages_;
  std::vector<std::string> stage_params_;                // trainable names of this rank's stages
  std::map<std::string, std::vector<int64_t>> foreign_;  // released parameters -> their shapes
  std::map<std::string, int> owner_;                     // parameter -> pipeline rank holding it
  std::unique_ptr<P2pMessenger> p2p_;
  std::unique_ptr<Engine> inner_;
  std::vector<int> step_replicas_;
  bool full_ = false;
  double compute_ms_ = 0;
  std::vector<std::string> term_keys_;
};

}  // namespace parallax::parallel::pipeline
