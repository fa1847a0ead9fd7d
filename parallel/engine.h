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
// are plain StatePiece values (parallel/state.h) the trainer converts. What an engine holds is
// measured by memory() and predicted, without an engine, by the rules of parallel/memory_rules.h.
// The data-parallel engines share their common part (parallel/ddp/data_parallel_engine.h).
//
// Thread-safety: one training thread. Errors: CommError/TimeoutError from the communicators,
// parallax::Error for misuse (a parameter without a gradient, named).
#pragma once

#include "comm/communicator.h"
#include "optim/grad_utils.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "parallel/memory.h"
#include "parallel/state.h"
#include "units/parallel_model.h"
#include "units/unit_hooks.h"

#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace parallax::parallel {

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

// What an engine measured of its last step (Engine::timing()).
struct StepTiming {
  bool timed = false;
  double backward_ms = 0;
  double exposed_comm_ms = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;

  // One line for the log: the engine, its group and its buckets or shards.
  virtual std::string describe() const = 0;
  // Re-broadcasts buffers from the group's rank 0 when the engine keeps them in sync that way
  // (parallel.ddp.broadcast_buffers); forward_backward does it before each forward when asked.
  virtual void broadcast_buffers() {}
  // One optimizer step's forwards and backwards over micro_batches() micro-batches: the call the
  // trainer makes, the same for every engine. Returns the loss terms summed over the micro-batches,
  // the same on every rank of a model replica (a pipeline sends the last stage's to the others).
  // `sync_buffers`: broadcast buffers before each forward (false under CUDA graph capture: the
  // trainer broadcasts once before the graph). The default runs fns.forward_loss through
  // forward_backward.
  virtual LossTerms step(const StepFns& fns, bool sync_buffers);
  // The micro-batches of a step (train.grad_accum). It enters an engine once, where the engine is
  // made (parallelize(): the pipeline's constructor, which plans its schedule for it, or
  // set_micro_batches for the others), and step() runs that many.
  int micro_batches() const { return micro_batches_; }
  void set_micro_batches(int micro_batches);
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

  // The group the engine reduces gradients over (null: none).
  virtual comm::CommPtr data_parallel_group() const = 0;
  // The world ranks that hold identical copies of every model parameter and buffer: the
  // data-parallel group's (DDP, ZeRO-1/2, a pipeline stage's inner engine; ZeRO-3's shards are
  // pieces of those copies). Empty without a group: this rank alone.
  std::vector<int> model_replicas() const;
  // The mean of a small float tensor over the data-parallel replicas, on the tensor's device
  // (GPUs: the compute stream waits for the all-reduce, the host does not): the normaliser a
  // model's loss uses so that the replicas' averaged gradients are one process's on the whole
  // batch (Model::set_replica_mean). Empty with one replica. A collective: call it inside step()
  // only, the same number of times on every replica.
  units::ReplicaMean replica_mean() const;
  // The optimizer state as pieces named "<param name>.<state>" and "step" (no prefix), views into
  // the live state: save them, or load into them and then call optimizer_state_loaded(). At most
  // one piece per name on each rank.
  virtual std::vector<StatePiece> optimizer_state() = 0;
  // After the pieces of the last optimizer_state() call were filled from a checkpoint.
  virtual void optimizer_state_loaded() = 0;

  // The hooks the model must call around each of its units (Model::set_unit_hooks), for an engine
  // that works unit by unit (ZeRO-3 gathers and frees there); nullptr: none needed. Owned by the
  // engine: uninstall them before the engine goes.
  virtual units::UnitHooks* unit_hooks() { return nullptr; }
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

  // What this rank holds (call after a step: gradients exist only after a backward); the rules of
  // parallel/memory_rules.h predict the same numbers.
  virtual EngineMemory memory() = 0;

  // Backward and exposed-communication time of the last step (ms; 0 when not measured), and
  // whether the engine measures them at all (the metrics show NaN otherwise).
  virtual StepTiming timing() const { return {}; }
  double last_backward_ms() const { return timing().backward_ms; }
  double last_exposed_comm_ms() const { return timing().exposed_comm_ms; }
  bool timed() const { return timing().timed; }

 protected:
  int micro_batches_ = 1;
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
