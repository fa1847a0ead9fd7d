// Internal to train/ (train/run.h is the API): the steps of build_run(), each in the source of
// its concern, and what the loop shares with them.
//   build_run.cpp   the order of the steps; the world (device, threads, communicator, plan,
//                   topology, run directory); the data; the engine; the outputs
//   run_model.cpp   the model: built (full, without storage, or shape-only), its weights
//                   (train.load_from, a checkpoint for eval and export), the extension's
//                   transform, FP8, the frozen model
//   run_resume.cpp  the checkpoint a resume trusts and what it restores (model, optimizer state,
//                   loss scale, RNG), naming the config keys that changed when a load fails
#pragma once

#include "checkpoint/reader.h"
#include "checkpoint/resume.h"
#include "checkpoint/save_state.h"
#include "parallel/state.h"
#include "train/run.h"

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace parallax::units {
class DeferredInit;
}

namespace parallax::train::detail {

// ---- build_run.cpp
// Step 1: the device and CPU threads of `run` (train, eval), on World::current().
void open_device(Run& run);
// Step 2's check: precision.mode=fp8 refused (ConfigError naming it) on a device without FP8
// tensor cores.
void require_fp8_device(const optim::PrecisionPolicy& precision, const c10::Device& device);
// Step 1: the world communicator (train, eval).
void open_world(Run& run);
// Step 1 (train): the plan, the run directory (locked), the topology, and the resume point.
void open_training_world(Run& run);
// Step 3: the scene the model is built for, and (train) the dataset's batch source.
void open_data(Run& run);

// ---- run_model.cpp
// Step 4 (train): the model, its weights (train.load_from; a resume's, except under ZeRO-3 over
// several ranks: after the engine), the extension's transform, FP8, and the frozen model.
// Returns the deferred-initialisation recipes the engine materialises (null: a full build).
std::shared_ptr<units::DeferredInit> build_training_model(Run& run);
// Step 4 (eval, export): the model with the weights of `source` (a checkpoint or a weights.h5),
// through the extension's restore where one is active (a LoRA run's merged adapters, a QAT run's
// quantisers); refused when a weight is not finite.
void restore_model(Run& run, const std::string& source);
// Step 4 (plan): the model shape-only (no parameter materialised), tp-way sharded over a group of
// one rank of `tp`, with the extension's transform and FP8 as a run applies them.
void build_shape_model(Run& run, int tp, bool sequence_parallel);
// precision.mode=fp8: the model's FP8 layers (attached to run.precision, with the MAX of their
// amaxes over the replicas of this rank's layers once the topology exists). ConfigError naming
// precision.mode where the model has none.
void apply_fp8(Run& run);

// ---- run_param_groups.cpp
// optim.param_groups and optim.layer_decay applied to run.model (train, plan), before any engine
// is built: the rules checked against the whole model's parameter names (ConfigError naming
// optim.param_groups[i].match for a rule that decides nothing, optim.param_groups when everything
// would be frozen, optim.layer_decay for a model without layers), the frozen rules' parameters set
// requires_grad false, run.param_group_rows filled; with `log`, rank 0 prints the table.
void apply_param_groups(Run& run, bool log);
// The model's layers (Model::layer_depth) as optim sees them.
optim::LayerOf layer_of(const models::Model& model);
// The table as the checkpoint's metadata extras: "optim.layer_decay", "optim.param_groups.count",
// "optim.param_groups.<i>.{match,lr_mult,weight_decay_mult,frozen,params}".
void save_param_groups(const Run& run, checkpoint::SaveState& state);
// Resume: warns (rank 0) once per rule that differs from the checkpoint's table, and once for
// layer_decay; silent for a checkpoint saved without a table.
void compare_param_groups(const Run& run);
// Resume: whether the optimizer state of `param` may be missing from the checkpoint (a frozen rule
// of the checkpoint's table matched it: the parameter was not trained then).
bool frozen_in_checkpoint(const Run& run, const std::string& param);

// ---- run_resume.cpp
// The checkpoint to resume from, agreed by every rank (train.resume); opens it into run.resume
// and sets run.start_step (build_run's step 1).
void choose_resume(Run& run);
// Runs `load`; a CheckpointError (a tensor of another shape, a missing state) is rethrown naming
// the changed config keys under `prefixes` (or all changed keys).
void with_config_hint(const Run& run, const std::vector<std::string>& prefixes,
                      const std::function<void()>& load);
// The model's checkpoint pieces (the engine's, or before it exists the module's own tensors)
// that TrainerHooks::saves_model_tensor keeps.
std::vector<parallel::StatePiece> checkpointed_model(const Run& run);
// Resume: the model tensors the checkpoint holds, into checkpointed_model()'s pieces.
void load_model_pieces(Run& run);
// Resume: the FP8 amax histories (a deferred pipeline model read its tensors before the FP8
// layers existed).
void load_fp8_histories(Run& run);
// Step 5 (train): the resumed optimizer state, loss scale, extension state and RNG, agreed by
// every rank; closes run.resume.
void load_resumed_state(Run& run);
// The advice of the non-finite loss error at `step`: `otherwise`, unless it is the first step of
// a run that started from train.load_from's weights (no update yet: they are the likely cause).
std::string nonfinite_loss_hint(const Run& run, int64_t step, const std::string& otherwise);

}  // namespace parallax::train::detail
