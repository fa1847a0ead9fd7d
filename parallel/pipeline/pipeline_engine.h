// The pipeline-parallel engine (plan step 3, parallel/parallelize.h): each pipeline rank holds a
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
// tensors. Their shapes are known on both sides before the first step: a shape pass runs
// micro-batch 0 through the stages in order (no autograd; buffers and random state restored
// after), as torch.distributed.pipelining's shape inference does, and tensors that cross a stage
// boundary keep those shapes (a sender whose outputs change shape stops with an error naming the
// stage, micro-batch and both shapes; Megatron-LM's fixed tensor_shape is the same rule). So every
// receive is posted with its buffers (reused, per stage and shape, once nothing holds them) where
// the plan lists it, and the sends and receives of one plan slot (a run of communication ops
// between two compute ops) go out as batch_isend_irecv calls: on NCCL each one ncclGroupStart/End
// on the communicator's stream, Megatron-Core's send_forward_recv_backward pattern, so two
// neighbours that send to each other at once never wait on each other's buffering. A slot is cut
// into several batches where its messages with one peer sit in different batches of that peer
// (comm_batches()): a group moves only as a whole, so under GPipe stage 0's last activation send
// must not share a group with its first gradient receive, which stage 1 posts later (check()
// proves every plan free of waits under that rule and under independent progress, MPI's and
// gloo's). A receive is
// completed right before the compute op that consumes it (on a device: the compute stream waits
// for it, the host does not); sends at the end of the step. The receiver checks each header
// against the plan (on a device at the end of the step, in one copy): a stage or micro-batch
// mismatch is an error naming both stages (Megatron-LM PR #5271: a silent swap trained on the
// wrong activations). On a transport that matches messages by order (NCCL;
// PipelineOptions::ordered_p2p) check_posting_order() proves both ends post each pair's messages
// in the same order. Before the first step every pair of neighbours exchanges one element both
// ways in one batch (connect_peers()): NCCL connects each direction lazily inside the first
// ncclGroupEnd that uses it and blocks there until the peer does the same, which hung GPipe
// (simulate_nccl(..., connect_up_front = false) shows it).
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
  // `pp`: the pipeline group; `micro_batches`: per step. `make_inner` builds the data-parallel
  // engine on the module once the stage's parameters are the only trainable ones.
  PipelineEngine(std::shared_ptr<torch::nn::Module> module, std::vector<core::Unit> units,
                 const std::vector<double>& costs, comm::CommPtr pp, int micro_batches,
                 const PipelineOptions& options,
                 const std::function<std::unique_ptr<Engine>()>& make_inner);

  std::string describe() const override;
  void broadcast_buffers() override { inner_->broadcast_buffers(); }
  // The schedule over the chain part of `fns` (begin / run / finish); then the loss terms, which
  // only the last stage computes, go from it to every stage (broadcast over the pipeline group:
  // the names once, the values each step), so every rank logs and checks the same loss.
  LossTerms step(int micro_batches, const StepFns& fns, bool sync_buffers) override;
  // The schedule alone, on stage functions whose finish() gives the loss to backpropagate (step()
  // runs this; tests and benchmarks call it directly).
  void forward_backward_stages(int micro_steps, const StageFns& fns, bool sync_buffers);
  // Not available: a pipeline runs stages (step()).
  void forward_backward(int micro_steps, const std::function<at::Tensor(int)>& micro,
                        bool sync_buffers) override;
  void forward_backward_split(int micro_steps, const MicroStepFns& fns, bool sync_buffers) override;
  std::vector<optim::GradGroup> grads() override;
  void update(double lr) override { inner_->update(lr); }
  void zero_grad() override { inner_->zero_grad(); }
  optim::Optimizer& optimizer() override { return inner_->optimizer(); }
  std::vector<int> model_replicas() const override { return inner_->model_replicas(); }
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
  struct Slot;  // one (micro-batch, stage)'s live tensors
  // The dtype and shape of each tensor of a message.
  struct TensorMeta {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    bool operator==(const TensorMeta& o) const { return dtype == o.dtype && shape == o.shape; }
  };
  using Layout = std::vector<TensorMeta>;
  // The shape pass (file comment): fills act_layout_.
  void connect_peers();
  void infer_layouts(const StageFns& fns);
  // The message a send or receive op moves: the activations of op.stage, or the gradients of its
  // inputs (the layout of stage op.stage - 1's outputs, floating ones; int64 placeholders of no
  // elements for the others).
  const Layout& layout_of(const Op& op) const;
  // A receive buffer of `meta` on the communication device, reused once nothing else holds it.
  at::Tensor buffer(const std::string& pool, const TensorMeta& meta);
  int tag(const Op& op, int k) const;
  std::map<std::size_t, std::size_t> batch_end_;  // comm_batches(): first op -> end
  bool ordered_ = false;                          // PipelineOptions::ordered_p2p, or a device group
  // Where the pipeline communicator's buffers live: the model's device when it is of the
  // communicator's type (each rank's own GPU, cuda:local_rank), else the current device of that
  // type (World made it local_rank's), never a fixed index.
  c10::Device comm_device() const;
  // The device of the stage's parameters (the first with storage; the CPU if none).
  c10::Device model_device() const;
  // `t` detached, contiguous, on comm_target_.
  at::Tensor to_comm(const at::Tensor& t) const;

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
  std::map<int, Layout> act_layout_;   // producing stage -> its outputs
  std::map<int, Layout> grad_layout_;  // producing stage -> the gradients of its inputs
  std::map<std::string, std::vector<at::Tensor>> pool_;
  bool layouts_known_ = false;
  c10::Device comm_target_{c10::kCPU};  // comm_device() of the current step
  // step(): the loss terms' names, sent once by the last stage.
  void sync_terms(LossTerms& terms);
  std::vector<std::string> term_keys_;
};

}  // namespace parallax::parallel::pipeline
