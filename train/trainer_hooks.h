// What the training loop offers the trainer extensions (train/extension.h): TrainerHooks, the
// extension points the QAT, LoRA and distillation extensions build on (a model transform before the
// parallel engine wraps the model, extra loss terms, a second frozen model, extra checkpoint
// entries, a prepare step), what a prepare step is given (TrainingStart), and what a run returns
// (TrainSummary). The run's assembly (train/run.h) and the loop (train/loop.h) call them; the
// trainer's API is train/trainer.h.
#pragma once

#include "comm/communicator.h"
#include "core/scene.h"
#include "core/tensor_dict.h"
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
  const comm::CommPtr& dp;  // the data-parallel group (every rank calls prepare); null in
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
  // inside a units::DeferredInitScope that continues the model's recipes, creates what it adds
  // through units::init_tensor or units::layer, and reads values through units::deferred_init()
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
  // transform_model checks the weights loaded before it (train.load_from) for non-finite values
  // itself (LoRA names them as its base); false: the assembly checks them as it loads them.
  bool checks_loaded_weights = false;
  // Which model tensors (module paths) checkpoints hold, and a resume reads back; empty: all.
  // LoRA saves only what trains (its adapters): the frozen base comes from elsewhere.
  std::function<bool(const std::string& name)> saves_model_tensor;
  // Extra checkpoint entries (e.g. adapter-only weights, calibration statistics): added to every
  // save, and read back on resume (after the model and optimizer state).
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

}  // namespace parallax::train
