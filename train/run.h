// The one assembly of a run (ARCHITECTURE §5, "One way to build a run"). `parallax train`,
// `parallax eval`, `parallax export` and `parallax plan` all get their world, plan, precision
// policy, model and engine from build_run(); none of them builds one by itself.
//
//   run = build_run(cfg, purpose, options)      purpose: train, eval, export or plan
//     1. world: the device, CPU threads, the world communicator (train, eval), the plan validated
//        once against the world (train) and its topology; the run directory and the checkpoint
//        to resume from (train). First, because everything after may fail on one rank alone and
//        must then fail on all: the world is what the ranks agree over.
//     2. precision: one optim::PrecisionPolicy (autocast, master weights, the loss scaler, FP8),
//        before anything is built, so that an FP8 run on a device without FP8 tensor cores is
//        refused before any work.
//     3. data: the scene the model is built for (a dataset's dataset.json, or the benchmark
//        scene), and for training the batch source. Before the model: its input shapes come
//        from the scenes.
//     4. model: built for the scene, with its tensor-parallel layers over the plan's group;
//        shape-only for plan, without storage where each rank materialises only what it owns
//        (parallel.meta_init). Then its weights: train.load_from, a resumed checkpoint, or for
//        eval and export the checkpoint asked for; and between them the active extension's
//        transform (LoRA adapters, QAT fake-quantisers: train/extension.h), which comes after the
//        pretrained weights it wraps and before a checkpoint saved from the transformed model.
//        FP8 layers last: after pretrained weights (which hold no scaling state), before the
//        resume (which does).
//     5. engine (train): parallel::parallelize() applies the plan (TP, recompute, pipeline
//        stages, DDP or ZeRO) with the optimizer; then the resumed optimizer state, loss scale
//        and RNG, which only exist once the engine has laid the parameters out.
//     6. outputs (train): the checkpointer and the metrics file, last, so that a start that
//        fails leaves nothing on disk.
//
// Every step is collective where its purpose has a world: every rank calls build_run() with the
// same config, and a rank that fails alone makes every rank fail with the same error
// (comm::agree_on). Errors: ConfigError / LayoutError (the config), CheckpointError (weights),
// DataError (the dataset), CommError / TimeoutError (the world).
#pragma once

#include "comm/communicator.h"
#include "core/scene.h"
#include "optim/precision.h"
#include "parallel/plan.h"
#include "train/run_config.h"
#include "train/trainer_hooks.h"

#include <c10/core/Device.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace parallax::comm {
class World;
class Topology;
}  // namespace parallax::comm
namespace parallax::parallel {
class Engine;
namespace tensor {
struct TpGroup;
}
}  // namespace parallax::parallel
namespace parallax::checkpoint {
class Checkpointer;
class CheckpointReader;
struct ConfigChange;
}  // namespace parallax::checkpoint

namespace parallax::train {

class BatchSource;
class MetricsWriter;
class RunDirectory;
class CudaStepGraph;
class Extension;

enum class Purpose { kTrain, kEval, kExport, kPlan };

// What build_run takes besides the config.
struct RunOptions {
  // train: the hooks of the trainer (default: the active extension's, train/extension.h; tests
  // pass their own).
  std::optional<TrainerHooks> hooks;
  // eval and export: the checkpoint (a directory, a run's checkpoints/ or a weights.h5) whose
  // weights the model takes.
  std::string weights;
  // plan: the tensor-parallel degree and sequence parallelism of the shape-only model.
  int plan_tp = 1;
  bool plan_sequence_parallel = false;
};

// An assembled run. Owns everything build_run made; members are filled as the purpose needs
// (left empty otherwise, as noted). Destroyed in reverse order of construction: the engine (which
// owns the unit hooks installed in the model) before the model, the communicators last.
struct Run {
  Run(const RunConfig& cfg, Purpose purpose);
  ~Run();
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  const RunConfig& cfg;
  const Purpose purpose;
  TrainerHooks hooks;                    // train
  const Extension* extension = nullptr;  // the active extension, if any

  // 1. The world (train, eval).
  comm::World* world = nullptr;
  c10::Device device{c10::kCPU};
  int threads = 1;  // intra-op CPU threads of this rank
  bool rank0 = true;
  comm::CommPtr world_comm;
  parallel::Plan plan;                            // train
  std::unique_ptr<comm::Topology> topo;           // train
  std::shared_ptr<parallel::tensor::TpGroup> tp;  // train and plan with tp > 1
  std::unique_ptr<RunDirectory> run_directory;    // train: locked for the run's lifetime
  std::filesystem::path dir;                      // train: the run directory
  std::string config_text;                        // train: the resolved config
  // train: the checkpoint resumed from, open while the run is assembled.
  std::unique_ptr<checkpoint::CheckpointReader> resume;
  std::vector<checkpoint::ConfigChange> config_changes;  // vs the resumed checkpoint's config
  bool resumed = false;  // a checkpoint was loaded (its step may be 0: a ptq run)
  // train.load_from's load report as JSON (checkpoint/weights.h WeightsReport::json), written as
  // metrics.jsonl's "load" row when the run opens its outputs; empty without a load.
  std::string load_report;
  int64_t start_step = 0;

  // 2. Precision.
  optim::PrecisionPolicy precision;

  // 3. Data.
  core::SceneSpec scene;
  std::unique_ptr<BatchSource> source;  // train
  bool synthetic = true;                // train: synthetic batches (no evaluation)
  bool no_eval_split = false;           // train: a dataset without data.val_split

  // 4. The model, and (train) the extension's frozen model (a distillation teacher).
  std::shared_ptr<models::Model> model;
  std::shared_ptr<models::Model> frozen;
  std::string loaded;  // eval, export: what was read into the model, for the report
  // optim.param_groups as applied to the model (train, plan): the start table's rows, which
  // checkpoints record (train/run_param_groups.cpp).
  std::vector<optim::GroupRow> param_group_rows;

  // 5. The engine (train): owns the optimizer, the micro-batch loop and the layout of
  // parameters, gradients and optimizer state across ranks.
  std::unique_ptr<parallel::Engine> engine;
  std::unique_ptr<CudaStepGraph> graph;  // train.cuda_graph

  // 6. Outputs (train).
  std::unique_ptr<checkpoint::Checkpointer> checkpointer;  // null in benchmark mode
  std::unique_ptr<MetricsWriter> metrics;                  // disabled on ranks other than 0

  // Whether the run evaluates on a validation split (a bev model on a dataset that has one).
  bool evaluates() const;
};

// Intra-op CPU threads of a rank (build_run's step 1 for train and eval): `configured`
// (train.threads) when positive; else OMP_NUM_THREADS where it is a positive integer (its first
// entry), as PyTorch reads it; else the cores this process may run on (its affinity mask), at most
// the node's cores / `local_ranks`. At least 1.
int intra_op_threads(int configured, int local_ranks);

// Assembles the run of `cfg` for `purpose` (the steps above). train and eval need the process's
// World (comm::World::current()); export and plan run in one process without one.
std::unique_ptr<Run> build_run(const RunConfig& cfg, Purpose purpose, RunOptions options = {});

}  // namespace parallax::train
