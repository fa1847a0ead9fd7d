// ZeRO stages 1, 2 and 3 over the data-parallel group (parallel.zero.stage), on the gradient
// buckets DDP uses (parallel/ddp/grad_buckets.h, in reduce-scatter mode).
//
// Layout. Trainable parameters are bucketed in reverse registration order, one bucket per (dtype,
// optimizer parameter group) (stage 3: per (unit, dtype, group), in reverse unit order, so each
// unit's gradients are reduce-scattered as soon as its backward is done), each padded to a multiple
// of the dp size N. Each bucket owns a flat parameter buffer and the parameters become views into
// it. Rank r owns elements [r S, (r + 1) S) of every bucket (S = padded size / N): the optimizer is
// built over the pieces of parameters that fall in that range (1-D views into the flat parameter
// buffer, stage 3: into this rank's persistent shard of it), so its state (Adam moments, and fp32
// masters of bf16/fp16 parameters) is 1/N of the model's on each rank.
//
// A step. Backward fills the flat gradient buffers (DDP's hooks, launched in bucket order as
// buckets complete, overlapped with backward); each bucket is reduce-scattered (average) into its
// shard. Stage 1 reduces once, in the last micro-step (the others accumulate locally); stages 2 and
// 3 reduce in every micro-step and accumulate the shards. The optimizer updates this rank's pieces
// in place; then (stages 1 and 2) every bucket's flat parameter buffer is all-gathered in place,
// so every rank holds the whole updated model before the next forward. Stage 3 keeps only the
// shards: each unit's parameters are gathered around its forward and its backward and freed after
// (parallel/zero/param_shards.h), through the hooks the model calls (unit_hooks()).
//
// Checkpoints. The optimizer state is saved per parameter, under "<param name>.<state>" with the
// parameter's global shape; a rank's piece of each state tensor is one flat range of it
// (StatePiece::flat_begin), which the checkpoint stores as such and reads back from any layout.
// Stage 3 saves the parameters the same way (model_state()). Nothing depends on the bucket layout,
// so a checkpoint loads under any dp size, ZeRO stage or bucket size.
//
// Gradient memory. Stage 1 keeps persistent flat gradient buffers (the parameters' gradients are
// views into them, accumulating locally over micro-steps). Stages 2 and 3's buckets are transient:
// each gradient is copied into its bucket's buffer as autograd produces it and dropped, and the
// buffer is released once its reduce-scatter is issued (freed when the collective completes), so
// between steps a rank holds only its shards.
//
// Limits of this version: no CUDA graph capture (parallel/plan.cpp refuses it); on CPU backends a
// transient bucket's memory returns when finalize waits for the collective (end of backward), on
// GPUs when the communication stream has used it.
//
// Deferred initialisation (stage 3). Given the recipes of a model built under
// core::DeferredInitScope (its parameters placeholders, core::place_deferred), the engine fills
// each unit's flat parameter from the recipes and keeps only this rank's shard, one unit at a
// time: no rank ever holds the whole model, and the values are bitwise those of a full build
// (every rank replays the same recipes, so nothing is broadcast).
#pragma once

#include "core/param_init.h"
#include "parallel/ddp/ddp.h"
#include "parallel/engine.h"
#include "parallel/zero/param_shards.h"

namespace parallax::parallel::zero {

// The bucket key of a parameter of optimizer group `group` (-1: none) and, under stage 3, of unit
// `unit` of `n_units` (-1: not keyed by unit): buckets never mix groups (their weight decay
// differs), units (stage 3 gathers and frees a unit's flat parameter) or tp-sharded with
// tp-replicated parameters. Keys ascend in reverse unit order, so buckets come out (and are
// launched) last unit first, the order of the backward. `n_groups`: the group count + 1.
int bucket_key(int group, int unit, int n_groups, int n_units, bool tp_sharded);

class ZeroEngine : public Engine {
 public:
  // `stage` 1, 2 or 3. Broadcasts parameters and buffers from dp rank 0, builds the buckets and
  // the flat parameter buffers, then the optimizer over this rank's pieces with `make`. Stage 3
  // needs the model's `units` (every parameter in exactly one; Error naming the one that is not)
  // and shards the parameters at once: install unit_hooks() in the model before its next forward.
  // `prefetch` (stage 3): gather the next unit while the current one computes. `always_gather`
  // (stage 3): gather and free even with one rank, where the shard is the whole parameter (tests
  // of that path on one GPU; otherwise one rank skips it). `deferred` (stage 3 only): the
  // model's recipes (deferred initialisation above); null: the parameters hold their values.
  ZeroEngine(std::shared_ptr<torch::nn::Module> module, std::vector<optim::ParamGroup> groups,
             const OptimizerFactory& make, comm::CommPtr dp, ddp::DdpOptions options, int stage,
             std::vector<core::Unit> units = {}, bool prefetch = true, bool always_gather = false,
             TensorParallelInfo tp = {},
             std::shared_ptr<const core::DeferredInit> deferred = nullptr);
  ~ZeroEngine() override;

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
  core::UnitHooks* unit_hooks() override { return shards_.get(); }
  // Stage 3 over N > 1 ranks: each parameter's flat range in this rank's shard, and the buffers
  // (whole, replicated over dp); otherwise empty (the module's tensors are whole).
  std::vector<StatePiece> model_state() override;
  void gather_full_params() override;
  void release_full_params() override;
  void commit_full_params() override;

  // What memory() measures after a step, predicted for fp32 `params` (this rank's, registration
  // order; parallel/build_engine.h: predicted_memory): the buckets this engine would build and
  // this rank's shard of each (parameters, gradients, optimizer state), frozen parameters whole
  // (stage 3 over several ranks: 1/N of each unit's).
  static EngineMemory memory_rule(int stage, const std::vector<ParamInfo>& params,
                                  const MemoryQuery& q);
  // Parameters (whole: the flat buffers; stage 3: the shards and whatever is gathered now),
  // gradients (flat buffers, the reduce-scatter shards and, stages 2 and 3, the shard
  // accumulators), optimizer state (moments and masters of this rank's pieces).
  EngineMemory memory() override;

  // The gradient buckets' timers (parallel/ddp/ddp.h): the last synced backward and the
  // reduce-scatter time it did not hide.
  double last_backward_ms() const override { return buckets_->last_backward_ms(); }
  double last_exposed_comm_ms() const override { return buckets_->last_exposed_comm_ms(); }
  bool timed() const override { return timing_; }

 private:
  // A parameter's part in this rank's shard: elements [begin, end) of the flattened parameter.
  struct Piece {
    std::string name;
    std::vector<int64_t> shape;  // the parameter's
    int64_t begin = 0, end = 0;
    int64_t param_index = 0;   // into params_
    at::Tensor param, grad;    // 1-D views: flat parameter buffer, shard accumulator
    std::vector<int> holders;  // world ranks holding a piece of this parameter (in order)
    std::size_t bucket = 0;    // its bucket, and its offset in this rank's shard of it
    int64_t shard_offset = 0;
  };

  std::shared_ptr<torch::nn::Module> module_;
  comm::CommPtr dp_;
  int stage_;
  bool timing_ = true;
  bool broadcast_buffers_ = true;  // parallel.ddp.broadcast_buffers, before each forward
  // Stages 2 and 3 over several ranks: every micro-step is reduce-scattered (transient buckets) and
  // the shards accumulate. With one rank there is nothing to scatter: the gradients accumulate in
  // the flat buckets, which are the shards, as in stage 1.
  bool reduce_each_micro_ = false;
  std::unique_ptr<ddp::GradBuckets> buckets_;  // the gradient buckets (reduce-scatter)
  std::vector<at::Tensor> flat_params_;        // per bucket, padded
  std::vector<at::Tensor> grad_acc_;           // per bucket, the reduce-scatter's shard
  std::vector<at::Tensor> shard_acc_;          // stage 2 with several micro-steps: the shards' sum
  bool accumulating_pieces_ = false;           // the pieces' gradients point into shard_acc_
  std::vector<at::Tensor> params_;             // trainable parameters, registration order
  std::vector<Piece> pieces_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::vector<std::pair<std::string, at::Tensor>> held_;  // the last optimizer_state()
  std::unique_ptr<ParamShards> shards_;                   // stage 3
  TensorParallelInfo tp_;  // tp-sharded and replicated parameters never share a bucket
};

}  // namespace parallax::parallel::zero
