// Internal to the trainer (train/trainer.h is the public API): the TrainerImpl class that
// Trainer wraps, shared by its sources, each one concern:
//   trainer.cpp        the loop: fit(), one training step (eager or a CUDA graph), evaluation,
//                      logging, the preparation step
//   trainer_setup.cpp  setup(): the device, the world and its layout, the run directory, resume,
//                      data, the model, the parallel plan applied and the engine built
//   trainer_state.cpp  checkpoints: saving, loading on resume, and the config comparison that
//                      names what changed when a load fails
//   trainer_load.cpp   which checkpoint a resume trusts (checksums verified), and what the
//                      weights of train.load_from are blamed for
#pragma once

#include "train/trainer.h"

#include "checkpoint/checkpointer.h"
#include "checkpoint/config_record.h"
#include "checkpoint/finite.h"
#include "checkpoint/format.h"
#include "checkpoint/reader.h"
#include "checkpoint/resume.h"
#include "checkpoint/training_state.h"
#include "checkpoint/weights.h"
#include "core/build_info.h"
#include "core/error.h"
#include "core/log.h"
#include "core/param_init.h"
#include "core/progress.h"
#include "core/rng.h"
#include "core/strings.h"
#include "core/timer.h"
#include "models/checkpointable.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "optim/grad_utils.h"
#include "optim/optimizer.h"
#include "optim/precision.h"
#include "optim/schedule.h"
#include "parallel/comm/agree.h"
#include "parallel/comm/factory.h"
#include "parallel/comm/topology.h"
#include "parallel/comm/world.h"
#include "parallel/parallelize.h"
#include "parallel/state.h"
#include "parallel/tensor/tensor_parallel.h"
#include "train/batch_source.h"
#include "train/cuda_graph.h"
#include "train/distill.h"
#include "train/evaluate.h"
#include "train/metrics.h"
#include "train/preemption.h"
#include "train/profiler.h"
#include "train/qat.h"
#include "train/run_dir.h"

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <fmt/ranges.h>

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace parallax::train::detail {

namespace fs = std::filesystem;
namespace comm = parallel::comm;
namespace ck = checkpoint;
namespace tensor = parallel::tensor;

class TrainerImpl {
 public:
  TrainerImpl(RunConfig& cfg, TrainerHooks hooks)
      : cfg_(cfg), hooks_(std::move(hooks)), world_(comm::World::current()) {}
  // The engine owns the unit hooks installed in the model, and goes first.
  ~TrainerImpl() {
    if (model_) model_->set_unit_hooks(nullptr);
  }

  TrainSummary fit();

 private:
  void setup();
  // Resume: warns (rank 0) about each key of `config_text` that differs from the config the
  // checkpoint was saved with, and keeps the list for with_config_hint.
  void compare_config(const std::string& config_text);
  // Runs a load from the checkpoint; a CheckpointError (a tensor of another shape, a missing
  // state) is rethrown naming the changed config keys under `prefixes` (or all changed keys).
  void with_config_hint(const std::vector<std::string>& prefixes,
                        const std::function<void()>& load) const;
  // A checkpoint committed before non-finite saves were refused may hold NaN: refuse to train on.
  void check_resumed_state_finite() const;
  // The checkpoint to resume from (ck::find_resume_point), agreed by every rank. Under
  // train.resume=auto the ranks also stream the shards' checksums of the one chosen, each its
  // share, and fall back to an older checkpoint (with a warning) when one does not match, as for a
  // truncated shard. Warns (rank 0) that train.load_from is ignored when a checkpoint is found.
  std::optional<ck::ResumePoint> choose_resume_point(const std::string& checkpoints_dir);
  // The advice of the non-finite loss error at `step`: `otherwise`, unless it is the first step of
  // a run that started from train.load_from's weights (no update yet: they are the likely cause).
  std::string nonfinite_loss_hint(int64_t step, const std::string& otherwise) const;
  // Rank 0: creates the run directory, records `config_text` as config.yaml (the replaced one goes
  // to config_history/), trims metrics.jsonl to the rows of steps <= start_step_ and opens it.
  // Other ranks get a disabled metrics writer.
  void open_run_directory(const std::string& config_text);
  // Evaluates on the validation split (dataset runs of BEV models) and logs "eval" metrics. A
  // preemption signal stops it on every rank alike: no row, eval_preempted_ set.
  void run_eval(int64_t step);
  // TrainerHooks::prepare, then its metrics row; false (on every rank) when a preemption signal
  // stopped it (train/preemption.h).
  bool prepare();
  // Saves model, optimizer, RNG, loss scaler and data position as checkpoint `step`, after making
  // the metrics rows logged so far durable. Call it after step `step`'s rows and evaluation.
  void save_checkpoint(int64_t step);
  // One optimizer step of grad_accum micro-steps; returns the loss terms of this rank (device
  // tensors, averaged over micro-steps). `log_step`: the gradient norm is needed for the metrics
  // (without clipping it is computed only then).
  std::map<std::string, at::Tensor> train_step(int64_t step, double lr, bool log_step);
  // train_step with train.cuda_graph: warm-up steps eager, then one capture and a replay per step.
  std::map<std::string, at::Tensor> graph_step(int64_t step, double lr, bool log_step);
  // Forward, backward (DDP), unscale, clip and optimizer step on the micro-batches
  // batch_of(0..accum-1). Leaves the gradients in place. No host synchronisation on GPUs unless
  // fp16 loss scaling is on.
  std::map<std::string, at::Tensor> compute_step(
      const std::function<core::TensorDict(int)>& batch_of, double lr, bool log_step);
  // Runs a graph launch or drain. A replay that never finished (a peer stopped inside a captured
  // collective) leaves this process's streams and communicators stuck, so no graceful shutdown is
  // possible: the error is printed and the job is torn down (World::abort, MPI_Abort under mpirun).
  void replay_or_abort(const std::function<void()>& launch);
  // graph_step's inputs: the source's next grad_accum batches copied into graph_inputs_ (which the
  // first call allocates); a DataError names a key whose shape differs from the captured one.
  void stage_graph_inputs(int64_t step);
  // Resume: the engine's optimizer state pieces, read from resume_.
  void load_optimizer_state();
  // Resume: the model tensors checkpoints hold (the engine's shards under ZeRO-3 over several
  // ranks, else the module's tensors), read from resume_.
  void load_model_pieces();
  // The model's checkpoint pieces (Engine::checkpoint_model; before the engine exists the module's
  // own tensors, parallel/state.h) that TrainerHooks::saves_model_tensor keeps.
  std::vector<parallel::StatePiece> checkpointed_model() const;
  // train.cuda_graph: refuses what a captured step cannot do, naming the key (the model's own
  // blockers are checked once it is built).
  void check_graph_capturable() const;

  RunConfig& cfg_;
  TrainerHooks hooks_;
  comm::World& world_;
  c10::Device device_{c10::kCPU};
  comm::CommPtr world_comm_;
  std::unique_ptr<comm::Topology> topo_;
  // The tensor-parallel group the model's layers were built over (null: tp = 1), which
  // parallelize() and the model's checkpoint pieces before the engine exists take with the plan.
  tensor::TpPtr tp_;
  // Locked for the trainer's lifetime; declared before everything that writes into it.
  std::optional<RunDirectory> run_directory_;
  fs::path run_dir_;
  std::shared_ptr<models::Model> model_;
  std::shared_ptr<models::Model> frozen_;  // TrainerHooks::frozen_model (eval, no gradients)
  parallel::Plan plan_;
  // The parallel engine (parallel/engine.h): owns the optimizer, the micro-batch loop and the
  // layout of parameters, gradients and optimizer state across ranks.
  std::unique_ptr<parallel::Engine> engine_;
  void record_engine_memory(int64_t step);
  // Mean over the data-parallel group, installed on the model around each training step (empty
  // with one data-parallel rank); see models::Model::set_replica_mean.
  models::ReplicaMean replica_mean_;
  optim::PrecisionPolicy precision_;
  std::unique_ptr<optim::LossScaler> scaler_;
  // precision.mode=fp8: the model's FP8 layers (kernels/fp8.h) and the MAX all-reduce of the
  // delayed recipe's amaxes over the replicas of this rank's layers (dp, then tp).
  void enable_fp8();
  // The delayed FP8 recipe's amax histories from the resumed checkpoint, where the model was read
  // into its recipes before enable_fp8() added them (a pipeline built with parallel.meta_init).
  void load_fp8_histories();
  std::vector<kernels::fp8::Fp8LinearImpl*> fp8_layers_;
  kernels::fp8::AmaxReducer fp8_reduce_;
  std::unique_ptr<BatchSource> source_;
  std::unique_ptr<ck::Checkpointer> checkpointer_;
  std::unique_ptr<ck::CheckpointReader> resume_;  // open only during setup
  std::vector<ck::ConfigChange> config_changes_;  // vs the resumed checkpoint's config
  int64_t start_step_ = 0;
  bool resumed_ = false;         // a checkpoint was loaded (its step may be 0: a ptq run)
  bool eval_preempted_ = false;  // run_eval() stopped for preemption: stop after saving
  bool model_tensors_logged_ = false;
  bool synthetic_ = true;
  bool no_eval_split_ = false;  // a dataset without data.val_split (train.eval_every = 0)
  core::SceneSpec scene_;
  std::unique_ptr<MetricsWriter> metrics_;
  bool rank0_ = true;
  // Per-interval accumulators (reset at each log step).
  double data_ms_ = 0, comm_ms_ = 0, backward_ms_ = 0;
  at::Tensor grad_norm_;
  bool found_inf_ = false;
  // train.cuda_graph: the graph, the captured input buffers (one batch per micro-step) and the
  // captured step's loss terms (overwritten by each replay).
  std::unique_ptr<CudaStepGraph> graph_;
  std::vector<core::TensorDict> graph_inputs_;
  std::map<std::string, at::Tensor> graph_terms_;
};

}  // namespace parallax::train::detail
