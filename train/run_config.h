// The root config of a run (`parallax train --config X`): every section of ARCHITECTURE.md, each
// owned by its layer, plus the `experiment` and `train` sections owned here, and the sections of
// the trainer extensions (train/config_sections.h), which it holds without naming them.
#pragma once

#include "core/scene.h"

#include "checkpoint/checkpoint_config.h"
#include "core/config.h"
#include "data/data_config.h"
#include "models/model_config.h"
#include "optim/optim_config.h"
#include "parallel/parallel_config.h"
#include "train/config_sections.h"

#include <string>

namespace parallax::train {

struct ExperimentConfig {
  std::string name = "default";
  int64_t seed = 42;
  std::string output_dir = "runs";
  bool overwrite = false;

  template <class V>
  void visit(V& v) {
    v("name", name,
      "run name, one folder name (no '/', not '.' or '..'): outputs go to <output_dir>/<name>",
      core::Check::path_component());
    v("seed", seed, "global seed (model init, data order, augmentation)", core::Check::at_least(0));
    v("output_dir", output_dir, "parent folder of run directories (relative or absolute)");
    v("overwrite", overwrite,
      "start again from step 0 in a run directory that holds an earlier run's checkpoints "
      "(train.resume empty): its checkpoints, metrics, plots and config are deleted first; "
      "false refuses such a start");
  }
};

struct TrainConfig {
  int64_t steps = 100;
  int64_t epochs = 0;  // if > 0, overrides steps
  int grad_accum = 1;
  int64_t eval_every = 0;
  int64_t log_every = 10;
  std::string activation_checkpointing = "none";
  std::string resume;     // "" | auto | <checkpoint dir>
  std::string load_from;  // weights-only initialisation
  bool strict_load = true;
  std::string device = "auto";
  bool benchmark = false;
  int threads = 0;            // intra-op CPU threads per rank; 0: train::intra_op_threads
  int64_t profile_steps = 0;  // > 0: Chrome trace of that many steps
  int64_t profile_start = 5;
  bool cuda_graph = false;        // capture the whole step into a CUDA graph (train/cuda_graph.h)
  int64_t cuda_graph_warmup = 3;  // eager steps before the capture

  template <class V>
  void visit(V& v) {
    v("steps", steps, "optimizer steps to run", core::Check::at_least(0));
    v("epochs", epochs, "if > 0, train this many epochs instead of `steps`",
      core::Check::at_least(0));
    v("grad_accum", grad_accum, "micro-steps per optimizer step (at most 65536, as parallax plan)",
      core::Check::between(1, 65536));
    v("eval_every", eval_every, "evaluate every N steps (0: only at the end)",
      core::Check::at_least(0));
    v("log_every", log_every, "log metrics every N steps", core::Check::at_least(1));
    v("activation_checkpointing", activation_checkpointing,
      "recompute transformer blocks in backward",
      core::Check::one_of({"none", "full", "selective"}));
    v("resume", resume, "resume from a checkpoint: '' (no), 'auto' (latest) or a path");
    v("load_from", load_from,
      "initialise weights (fresh optimizer) from a checkpoint, a run, weights.h5, a .safetensors "
      "file or sharded set, or a torch.save file (.pt/.pth/.bin); model.pretrained says how a "
      "foreign file's names map");
    v("strict_load", strict_load,
      "load_from (a Parallax checkpoint or weights.h5): every tensor must match by name and "
      "shape");
    v("device", device, "compute device", core::Check::one_of({"auto", "cpu", "cuda"}));
    v("benchmark", benchmark, "benchmark mode: synthetic batches, no eval or checkpoints");
    v("threads", threads,
      "intra-op CPU threads per rank (0: $OMP_NUM_THREADS where set, else this process's cores / "
      "ranks on the node)",
      core::Check::at_least(0));
    v("profile_steps", profile_steps,
      "record this many steps with the Kineto profiler into <run>/profile/trace_rank<r>.json (0: "
      "off)",
      core::Check::at_least(0));
    v("profile_start", profile_start, "first profiled step", core::Check::at_least(1));
    v("cuda_graph", cuda_graph,
      "capture forward, backward, DDP's all-reduces and the optimizer step into one CUDA graph, "
      "replayed each step "
      "(GPU; static shapes; not with fp16 loss scaling, find_unused or debug_collectives)");
    v("cuda_graph_warmup", cuda_graph_warmup,
      "eager steps before the capture (lazy initialisation: cuBLAS workspaces, NCCL connections, "
      "optimizer state)",
      core::Check::at_least(1));
  }
};

struct RunConfig {
  ExperimentConfig experiment;
  models::ModelConfig model;
  data::DataConfig data;
  parallel::ParallelConfig parallel;
  optim::PrecisionConfig precision;
  optim::OptimConfig optim;
  optim::ScheduleConfig schedule;
  TrainConfig train;
  checkpoint::CheckpointConfig checkpoint;
  checkpoint::ExportConfig export_;
  // The trainer extensions' sections (qat, lora, distill: train/extension.h), in their order.
  ExtensionSections extensions;

  template <class V>
  void visit(V& v) {
    v("experiment", experiment);
    v("model", model);
    v("data", data);
    v("parallel", parallel);
    v("precision", precision);
    v("optim", optim);
    v("schedule", schedule);
    v("train", train);
    v("checkpoint", checkpoint);
    v("export", export_);
    extensions.visit(v);
  }

  // Cross-section rules; throws ConfigError naming the keys.
  void validate() const { optim.validate(); }
};

}  // namespace parallax::train

namespace parallax::train {

// Defaults <- `file` (with its `_base_` chain) <- `overrides`; validated. Throws ConfigError.
RunConfig load_run_config(const std::string& file, const std::vector<std::string>& overrides);

// The resolved config as YAML (every key, defaults included): what runs/<name>/config.yaml holds.
std::string resolved_yaml(RunConfig& cfg);

// Whether a run trains on synthetic batches (data.synthetic, benchmark mode, or a model other than
// bev) rather than on the dataset at data.path.
bool uses_synthetic_data(const RunConfig& cfg);
// The scene a run's model is built for: the dataset's (its dataset.json), or for synthetic bev
// batches the size's benchmark scene, or none (models that take no scene). The trainer, `parallax
// export` and `parallax eval` build the same model through it. DataError for an unreadable dataset.
core::SceneSpec run_scene(const RunConfig& cfg);
// ConfigError naming both keys when data.frames and model.temporal.frames differ (synthetic
// batches may leave data.frames at 1: they come with the model's frames).
void check_frames(const RunConfig& cfg);

}  // namespace parallax::train
