// The training loop: config in; trained model, metrics, plots and the resolved config out.
//
// Trainer is the loop, with the extension points (TrainerHooks) that the QAT, LoRA and
// distillation trainers build on: a model transform before the parallel engine wraps the model,
// extra loss terms, a second frozen model, and extra checkpoint entries. run_training() is the
// plain trainer (no hooks).
//
// run_training() is collective: every rank of the World calls it with the same config. It builds
// the communicators and the DP x TP x PP topology, the model (on CPU or the rank's GPU), the DDP
// engine when dp > 1, the optimizer, LR schedule, precision policy and loss scaler, and the
// per-rank batch source; then runs `train.steps` optimizer steps of `train.grad_accum`
// micro-steps each. Rank 0 writes runs/<name>/config.yaml, metrics.jsonl and plots/ and prints
// progress lines with ETA.
//
// Errors: ConfigError/LayoutError before training starts; NumericsError on a non-finite loss (the
// message names the step; metrics logged so far are kept); CommError/TimeoutError from the
// communicators; DataError from the loader.
#pragma once

#include "core/scene.h"
#include "core/tensor_dict.h"
#include "parallel/comm/communicator.h"
#include "train/run_config.h"

#include <c10/core/Device.h>

#include <functional>
#include <map>
#include <memory>
#include <string>

namespace torch::nn {
class Module;
}
namespace parallax::models {
class Model;
}
namespace parallax::checkpoint {
class SaveState;
class CheckpointReader;
}  // namespace parallax::checkpoint

namespace parallax::train {

struct TrainSummary {
  std::string run_dir;
  int64_t steps = 0;
  double final_loss = 0;  // mean over the data-parallel group at the last step (NaN: none trained)
  double samples_per_s = 0;  // global throughput over the run (after the first step)
};

// What TrainerHooks::prepare gets: the trained model as the loop will run it, and the means to
// run it on training batches and to agree on statistics over the data-parallel replicas.
struct TrainingStart {
  models::Model& model;  // on `device`, wrapped by the engine; every parameter whole for the call
  bool resumed;          // a checkpoint was loaded (its model tensors and extras included)
  const parallel::comm::CommPtr& dp;  // the data-parallel group (every rank calls prepare); null in
                                      // unit tests: this process alone
  c10::Device device;
  // This rank's next training batch, on `device`: drawn from the training stream, whose position
  // the checkpoints record (a resume continues after what prepare drew).
  std::function<core::TensorDict()> next_batch;
  // model.forward(batch) under the run's autocast (precision.mode); no grad mode is set here.
  std::function<core::TensorDict(const core::TensorDict&)> forward;
  // The model's evaluation on the validation split as the run's eval rows compute it (collective
  // over dp; empty map where the run has no evaluation: synthetic batches). Not written anywhere.
  std::function<std::map<std::string, double>()> evaluate;
  // The run directory on rank 0 (where reports go); empty on the other ranks.
  std::string report_dir;
};

// What a specialised trainer adds to the loop. Every member is optional; each is called on every
// rank, the same way on each (collective code paths stay aligned).
struct TrainerHooks {
  // Changes the model after it is built and its pretrained weights (train.load_from) are loaded,
  // and before a resumed checkpoint is loaded (it was saved from the transformed model), before
  // activation checkpointing and before the parallel engine sees the parameters: e.g. LoRA adds
  // adapters and freezes the base (requires_grad false: the engine leaves frozen parameters out
  // of its buckets and the optimizer), QAT inserts fake-quantisers. Parameters it adds may be on
  // the CPU: the trainer moves the model to its device afterwards.
  std::function<void(models::Model& model)> transform_model;
  // transform_model also takes a model built without storage (parallel.meta_init): it then runs
  // inside a core::DeferredInitScope that continues the model's recipes, creates what it adds
  // through core::init_tensor or core::layer, and reads values through core::deferred_init()
  // (e.g. LoRA). false: a run with a transform builds the whole model on every rank.
  bool transform_defers = false;
  // A second model, frozen (eval mode, requires_grad false, never wrapped by the engine, not
  // checkpointed): e.g. a distillation teacher loaded from its own checkpoint. Built once, after
  // the trained model; moved to the training device.
  std::function<std::shared_ptr<models::Model>(const RunConfig& cfg, const core::SceneSpec& scene,
                                               c10::Device device)>
      frozen_model;
  // Extra loss terms of a micro-batch, given the batch, the trained model's predictions and the
  // frozen model (null without one): each is added to the model's loss total (so it backpropagates)
  // and logged as loss_<name>. Runs under the step's autocast; run the frozen model under
  // at::NoGradGuard.
  std::function<std::map<std::string, at::Tensor>(
      const core::TensorDict& batch, const core::TensorDict& pred, models::Model* frozen)>
      extra_loss;
  // Weight of the model's own loss in the total (e.g. distillation's distill.student_loss).
  double task_loss_weight = 1.0;
  // Extra checkpoint entries (e.g. adapter-only weights, calibration statistics): added to every
  // save, and read back on resume (after the model and optimizer state).
  // Which model tensors (module paths) checkpoints hold, and a resume reads back; empty: all.
  // LoRA saves only what trains (its adapters): the frozen base comes from elsewhere.
  std::function<bool(const std::string& name)> saves_model_tensor;
  std::function<void(checkpoint::SaveState& state)> save_extra;
  std::function<void(checkpoint::CheckpointReader& reader)> load_extra;
  // Runs once on every rank after the set-up (model, engine, data, a resume) and before the first
  // step: e.g. QAT's calibration. Collective when it uses `dp`. What it returns is written to
  // metrics.jsonl as one row of kind "prepare" at the starting step.
  std::function<std::map<std::string, double>(const TrainingStart& start)> prepare;
  // false: the run takes no optimizer step (QAT's ptq mode): after prepare, fit() evaluates and
  // saves one checkpoint at the starting step (0, or a resumed checkpoint's); train.steps is
  // ignored.
  bool trains = true;
};

// The training loop with hooks. Collective: every rank constructs one with the same config and
// calls fit(). Runs on the process's World (parallel::comm::World::current()).
class Trainer {
 public:
  explicit Trainer(RunConfig& cfg, TrainerHooks hooks = {});
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Sets up (communicators, plan, model, engine, data, resume) and trains `train.steps` steps.
  TrainSummary fit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The plain trainer: Trainer(cfg).fit().
TrainSummary run_training(RunConfig& cfg);

// precision.mode=fp8 applied to `model`: the ViT blocks' linear layers compute in FP8
// (models::enable_fp8) with cfg's precision.fp8 recipe. Returns how many layers; ConfigError naming
// precision.mode when the model has none. The trainer and `parallax plan` (which predicts the FP8
// layers' saved bytes) both apply it.
int apply_fp8(torch::nn::Module& model, const RunConfig& cfg);
// precision.mode=fp8 on `device`: ConfigError naming precision.mode where it has no FP8 tensor
// cores (the CPU, GPUs below compute capability 8.9). `parallax train` and `parallax eval` refuse
// alike, before anything is built.
void require_fp8_device(const c10::Device& device);
// Intra-op CPU threads of a rank (`parallax train` and `parallax eval`): `configured`
// (train.threads) when positive; else OMP_NUM_THREADS where it is a positive integer (its first
// entry), as PyTorch reads it; else the cores this process may run on (its affinity mask), at most
// the node's cores / `local_ranks`. At least 1.
int intra_op_threads(int configured, int local_ranks);

}  // namespace parallax::train
