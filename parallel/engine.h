// The seam between the trainer and every parallelism: one engine object owns how a step's
// forwards and backwards run over the micro-batches, which gradients the optimizer steps on, and
// how the parameters and optimizer state are laid out across ranks (ARCHITECTURE §5).
//
// The trainer (train/) builds the model, applies the validated plan (parallel/plan.h) in its
// fixed order, and hands the model's parameter groups and an optimizer factory to
// build_engine(). From then on it only talks to the Engine, the same calls whatever the layout:
//
//   engine.step(K, fns)                 one step's forwards and backwards over K micro-batches
//                                       (StepFns: the model whole and as a chain of units, and the
//                                       loss); returns the step's loss terms, the same on every
//                                       rank. The engine owns no-sync accumulation (DDP), gradient
//                                       reduction (all-reduce or reduce-scatter) and the pipeline
//                                       schedule with its point-to-point traffic.
//   engine.grads()                      the gradients the optimizer steps on, each group with the
//                                       communicators it is sharded over and replicated over, so
//                                       clipping and the inf check count every element once.
//   engine.update(lr)                   the optimizer update, then whatever makes the parameters
//                                       whole again (ZeRO: all-gather the updated shards).
//   engine.optimizer_state()            the optimizer state as pieces of per-parameter tensors
//                                       under their global names and shapes: boxes (DDP: whole
//                                       tensors) or flat ranges (a ZeRO rank's part of a
//                                       parameter), so any layout loads any other (checkpoint/
//                                       reads each piece from whatever saved shards overlap it).
//
// parallel/ sees no model or checkpoint type: the model is a torch::nn::Module, checkpoint pieces
// are plain StatePiece values the trainer converts.
//
// Thread-safety: one training thread. Errors: CommError/TimeoutError from the communicators,
// parallax::Error for misuse (a parameter without a gradient, named).
#pragma once

#include "core/boxes.h"
#include "core/parallel_model.h"
#include "core/unit_hooks.h"
#include "optim/grad_utils.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "parallel/comm/communicator.h"
#include "parallel/comm/topology.h"
#include "parallel/ddp/ddp_options.h"
#include "parallel/tensor/tensor_parallel.h"

#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace parallax::parallel {

// Tensor parallelism as the data-parallel engines see it (parallel/tensor/): the tp group, and the
// parameters whose tp ranks hold different pieces (column/row-parallel weights). Every other
// parameter is identical on every tp rank. The engines bucket and shard each rank's parameters
// over dp as they are, and report gradients so that clipping and the inf check sum the sharded
// ones over tp and count the replicated ones once.
struct TensorParallelInfo {
  comm::CommPtr tp;  // null or one rank: no tensor parallelism
  // The split parameters by full name, and how each is split (tensor::param_layouts of the
  // module); and the run's layout: what maps the engine's pieces to the single-process tensors a
  // checkpoint holds (parallel/state.h).
  std::map<std::string, tensor::ParamLayout> layouts;
  comm::Layout layout;
  bool active() const { return tp != nullptr && tp->size() > 1; }
  bool is_sharded(const std::string& name) const { return layouts.count(name) != 0; }
};

// One piece of a tensor of the training state, of the global tensor `name` (of shape
// `global_shape`): a box, [offsets, offsets + tensor.sizes()) (flat_begin < 0), or a flat range,
// elements [flat_begin, flat_begin + tensor.numel()) of the tensor's C-order flattening with
// `tensor` 1-D and `offsets` empty (flat_begin >= 0). The world ranks in `replicas` (this one
// included; empty: this rank alone) hold identical copies of that piece. `tensor` is a view into
// live state: saving reads it, loading writes into it (a flat range through its boxes,
// flat_range_boxes, each a contiguous run of `tensor`).
struct StatePiece {
  std::string name;
  at::Tensor tensor;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;
  std::vector<int> replicas;
  int64_t flat_begin = -1;
};

// The geometry of pieces (core/boxes.h), named here for the engines.
using core::Box;
using core::flat_range_boxes;

// Bytes of the distinct storages of `tensors` (views of one buffer count once, whole).
int64_t storage_bytes(const std::vector<at::Tensor>& tensors);

// Bytes one rank holds for training state (docs/PERFORMANCE.md's memory table): parameters,
// gradients (after a backward: flat buckets, shards, accumulators; each storage counted once) and
// optimizer state (moments, fp32 masters; per-parameter step counters left out).
struct EngineMemory {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t total() const { return params + grads + optimizer; }
};

// A parameter as an engine's memory rule sees it (Engine::memory() measured; the rules below
// predicted): `parallax plan` describes a shape-only model so and calls the engine's own rule.
struct ParamInfo {
  std::string name;
  int64_t numel = 0;
  int unit = 0;   // index into the model's units
  int group = 0;  // the optimizer's parameter group (optim::make_param_groups order)
  bool tp_sharded = false;
  bool trainable = true;  // false: frozen (a LoRA base weight)
};
// What else the rules need: the data-parallel group, the step's micro-batches, the model's
// units and the optimizer's groups and state, and the bucket options.
struct MemoryQuery {
  int dp = 1, dp_rank = 0;
  int micro_batches = 1;
  int units = 1;
  int groups = 1;                          // non-empty optimizer parameter groups
  double optimizer_bytes_per_element = 0;  // AdamW 8 (two fp32 moments), SGD with momentum 4
  ddp::DdpOptions ddp;
};

using OptimizerFactory =
    std::function<std::unique_ptr<optim::Optimizer>(std::vector<optim::ParamGroup>)>;

// A step's loss terms by name ("loss", "loss_<term>"): detached, each the sum over the step's
// micro-batches of what the trainer's loss gave for them (the trainer divides by their number).
using LossTerms = std::map<std::string, at::Tensor>;

// One micro-batch's loss.
struct MicroLoss {
  at::Tensor backprop;  // what the backward starts from (scaled for accumulation and the scaler)
  LossTerms terms;      // detached, to log
};

// The model of one step, as the trainer hands it to Engine::step(): whole (forward_loss) and as
// the model's chain of units (begin / run / finish, which a pipelined engine runs stage by stage,
// parallel/pipeline/pipeline_engine.h). An engine uses the form it needs; the trainer gives both,
// so it never asks which engine it has. parallel/ sees no model type.
struct StepFns {
  // The whole model on micro-batch `micro`: forward and loss.
  std::function<MicroLoss(int micro)> forward_loss;
  // What unit 0 takes for micro-batch `micro`.
  std::function<std::vector<at::Tensor>(int micro)> begin;
  // Units [first, last) of micro-batch `micro` on `in` (side inputs from the micro-batch).
  std::function<std::vector<at::Tensor>(int micro, int first, int last,
                                        const std::vector<at::Tensor>& in)>
      run;
  // The loss from the last unit's outputs.
  std::function<MicroLoss(int micro, const std::vector<at::Tensor>& out)> finish;
};

// Adds `from` into `into`, term by term.
void add_terms(LossTerms& into, const LossTerms& from);

// One micro-step in two parts (Engine::forward_backward_split).
struct MicroStepFns {
  std::function<void(int micro)> forward;
  std::function<void(int micro)> backward;
};

class Engine {
 public:
  virtual ~Engine() = default;

  // One line for the log: the engine, its group and its buckets or shards.
  virtual std::string describe() const = 0;
  // Re-broadcasts buffers from the group's rank 0 when the engine keeps them in sync that way
  // (parallel.ddp.broadcast_buffers); forward_backward does it before each forward when asked.
  virtual void broadcast_buffers() {}
  // One optimizer step's forwards and backwards over `micro_batches` micro-batches: the call the
  // trainer makes, the same for every engine. Returns the loss terms summed over the micro-batches,
  // the same on every rank of a model replica (a pipeline sends the last stage's to the others).
  // `sync_buffers`: broadcast buffers before each forward (false under CUDA graph capture: the
  // trainer broadcasts once before the graph). The default runs fns.forward_loss through
  // forward_backward.
  virtual LossTerms step(int micro_batches, const StepFns& fns, bool sync_buffers);
  // The whole-model engines' micro-batch loop (DDP, ZeRO): micro(i) runs forward + loss of
  // micro-batch i and returns the loss to backpropagate. The default runs forward_backward_split
  // with backward = micro(i).backward(); a pipelined engine refuses it.
  virtual void forward_backward(int micro_steps, const std::function<at::Tensor(int)>& micro,
                                bool sync_buffers);
  // The same, for a caller that runs each micro-step's backward itself (the pipeline: a stage's
  // backward starts from the output gradients it received, torch::autograd::backward(outputs,
  // grads), and zb's weight pass from the gradients its input pass kept). fns.forward(i) does
  // what comes before micro-step i's backward; fns.backward(i) runs one autograd pass that
  // accumulates into the parameters' .grad through their AccumulateGrad nodes, which the engine
  // observes (no-sync accumulation, bucket reduction) as it observes loss.backward().
  virtual void forward_backward_split(int micro_steps, const MicroStepFns& fns,
                                      bool sync_buffers) = 0;
  // The gradients the optimizer steps on (after forward_backward), with their layout.
  virtual std::vector<optim::GradGroup> grads() = 0;
  // The optimizer update with learning rate `lr`, then the parameters are made whole again.
  virtual void update(double lr) = 0;
  // Drops the gradients (PyTorch's zero_grad(set_to_none=True)).
  virtual void zero_grad() = 0;
  virtual optim::Optimizer& optimizer() = 0;

  // The world ranks that hold identical copies of every model parameter and buffer (the dp group
  // for DDP and ZeRO-1/2).
  virtual std::vector<int> model_replicas() const = 0;
  // The group the engine reduces gradients over (null: none).
  virtual comm::CommPtr data_parallel_group() const = 0;
  // The mean of a small float tensor over the data-parallel replicas, on the tensor's device
  // (GPUs: the compute stream waits for the all-reduce, the host does not): the normaliser a
  // model's loss uses so that the replicas' averaged gradients are one process's on the whole
  // batch (Model::set_replica_mean). Empty with one replica. A collective: call it inside step()
  // only, the same number of times on every replica.
  core::ReplicaMean replica_mean() const;
  // The optimizer state as pieces named "<param name>.<state>" and "step" (no prefix), views into
  // the live state: save them, or load into them and then call optimizer_state_loaded(). At most
  // one piece per name on each rank.
  virtual std::vector<StatePiece> optimizer_state() = 0;
  // After the pieces of the last optimizer_state() call were filled from a checkpoint.
  virtual void optimizer_state_loaded() = 0;

  // The hooks the model must call around each of its units (Model::set_unit_hooks), for an engine
  // that works unit by unit (ZeRO-3 gathers and frees there); nullptr: none needed. Owned by the
  // engine: uninstall them before the engine goes.
  virtual core::UnitHooks* unit_hooks() { return nullptr; }
  // The model's parameters and buffers as pieces named by their module path (no prefix), views
  // of live state, when the engine shards them (ZeRO-3); empty: the module's own tensors are whole
  // and replicated over model_replicas(), save them as they are.
  virtual std::vector<StatePiece> model_state() { return {}; }
  // Collective over the engine's groups: makes every parameter of the module whole until
  // release_full_params() (evaluation, export, reading weights in tests). No-op where they are.
  virtual void gather_full_params() {}
  virtual void release_full_params() {}
  // Between gather_full_params() and release_full_params(): the parameters were written in place
  // (QAT's calibration of learned scales writes their amax), the same values on every rank of the
  // model replicas; keep the writes (ZeRO-3: each rank copies its part into its shard). No
  // collective. No-op where the module's parameters are the engine's own storage.
  virtual void commit_full_params() {}

  // What a checkpoint holds, in the single-process names and shapes so that any layout loads any
  // other (parallel/state.h): of `module` (this engine's model), the engine's pieces where it
  // shards the model (model_state()) or else the module's tensors whole, replicated over
  // model_replicas(); of the optimizer, optimizer_state(); under tensor parallelism each piece of a
  // split tensor as the boxes of the whole tensor it holds. Views of live state: save them, or
  // load into them (then optimizer_state_loaded()). The trainer sees no layout.
  std::vector<StatePiece> checkpoint_model(const torch::nn::Module& module);
  std::vector<StatePiece> checkpoint_optimizer();
  // The tensor parallelism the engine was built with (none unless given).
  virtual const TensorParallelInfo& tensor_parallel() const;

  // What this rank holds (call after a step: gradients exist only after a backward).
  virtual EngineMemory memory() = 0;

  // Backward and exposed-communication time of the last step (ms; 0 when not measured).
  virtual double last_backward_ms() const { return 0; }
  virtual double last_exposed_comm_ms() const { return 0; }
  // Whether the engine measures those (the metrics show NaN otherwise).
  virtual bool timed() const { return false; }
};

// RAII: the module's parameters whole for the scope's lifetime (Engine::gather_full_params).
// Every rank of the engine's groups must open it at the same point.
class FullParams {
 public:
  explicit FullParams(Engine& engine) : engine_(engine) { engine_.gather_full_params(); }
  // Releasing is local (no collective); a failure there is logged by the engine, never thrown.
  ~FullParams() { engine_.release_full_params(); }
  FullParams(const FullParams&) = delete;
  FullParams& operator=(const FullParams&) = delete;

 private:
  Engine& engine_;
};

}  // namespace parallax::parallel
