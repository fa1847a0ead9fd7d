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
// Memory. parallel/memory_rules.h's zero_memory_rule predicts what memory() measures, from the same
// bucket keys (bucket_key.h) and DDP's bucket assignment.
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
// units::DeferredInitScope (its parameters placeholders, units::place_deferred), the engine fills
// each unit's flat parameter from the recipes and keeps only this rank's shard, one unit at a
// time: no rank ever holds the whole model, and the values are bitwise those of a full build
// (every rank replays the same recipes, so nothing is broadcast).
#pragma once

#include "parallel/ddp/data_parallel_engine.h"
#include "parallel/ddp/ddp.h"
#include "parallel/zero/bucket_key.h"
#include "parallel/zero/param_shards.h"
#include "units/param_init.h"

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace parallax::parallel::zero {

class ZeroEngine : public ddp::DataParallelEngine {
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
             std::vector<units::Unit> units = {}, bool prefetch = true, bool always_gather = false,
             TensorParallelInfo tp = {},
             std::shared_ptr<const units::DeferredInit> deferred = nullptr);
  ~ZeroEngine() override;

  std::string describe() const override;
  void broadcast_buffers() override;
  void forward_backward_split(int micro_steps, const MicroStepFns& fns, bool sync_buffers) override;
  std::vector<optim::GradGroup> grads() override;
  void update(double lr) override;
  void zero_grad() override;
  // One flat range per parameter piece of this rank; per-parameter scalars replicated over the
  // piece's holders.
  std::vector<StatePiece> optimizer_state() override;
  units::UnitHooks* unit_hooks() override { return shards_.get(); }
  // Stage 3 over N > 1 ranks: each parameter's flat range in this rank's shard, and the buffers
  // (whole, replicated over dp); otherwise empty (the module's tensors are whole).
  std::vector<StatePiece> model_state() override;
  void gather_full_params() override;
  void release_full_params() override;
  void commit_full_params() override;

  // Parameters (whole: the flat buffers; stage 3: the shards and whatever is gathered now),
  // gradients (flat buffers, the reduce-scatter shards and, stages 2 and 3, the shard
  // accumulators), optimizer state (moments and masters of this rank's pieces).
  EngineMemory memory() override;

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

  // The constructor's steps, in its order.
  // Each parameter's unit (stage 3; Error for a parameter in no unit or in two); empty otherwise.
  std::map<std::string, int> units_of_params(const std::vector<units::Unit>& units) const;
  // ZeRO's bucket options over DDP's: reduce-scatter, transient under stages 2 and 3, keyed by
  // group, unit and tp sharding (stage 3: no caps, and the launch tells the shards).
  ddp::DdpOptions bucket_options(ddp::DdpOptions options,
                                 const std::vector<optim::ParamGroup>& groups,
                                 std::shared_ptr<const std::map<std::string, int>> unit_of,
                                 int n_units);
  // A parameter's initial value, flattened (from `deferred`'s recipes, else its own).
  using InitialValue = std::function<at::Tensor(const std::string&, const at::Tensor&)>;
  // Bucket `bi`'s flat parameter buffer, its parameters made views of it, and this rank's pieces
  // (piece_of: index in pieces_ by name); stage 3 hands the buffer to the shards.
  void add_bucket(std::size_t bi, const std::map<std::string, int64_t>& index,
                  const std::map<std::string, int>& unit_of, const InitialValue& initial,
                  bool deferred, std::map<std::string, std::size_t>& piece_of);
  // Stage 3: the frozen parameters sharded per (unit, dtype), gathered with their unit.
  void shard_frozen(const std::map<std::string, int>& unit_of, const InitialValue& initial,
                    bool deferred);
  // The optimizer's groups over this rank's pieces (same names and weight decay as `groups`).
  std::vector<optim::ParamGroup> piece_groups(
      const std::vector<optim::ParamGroup>& groups,
      const std::map<std::string, std::size_t>& piece_of) const;

  int stage_;
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
  std::unique_ptr<ParamShards> shards_;  // stage 3
};

}  // namespace parallax::parallel::zero
