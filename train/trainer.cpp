#include "train/trainer.h"

#include "checkpoint/checkpointer.h"
#include "checkpoint/config_record.h"
#include "checkpoint/finite.h"
#include "checkpoint/format.h"
#include "checkpoint/reader.h"
#include "checkpoint/resume.h"
#include "checkpoint/training_state.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "core/log.h"
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
#include "parallel/build_engine.h"
#include "parallel/comm/agree.h"
#include "parallel/comm/factory.h"
#include "parallel/comm/topology.h"
#include "parallel/comm/world.h"
#include "parallel/pipeline/pipeline_engine.h"
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
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <cstring>
#include <vector>

namespace fs = std::filesystem;

namespace parallax::train {
namespace {

namespace comm = parallel::comm;
namespace ck = checkpoint;

// The model's state as checkpoint pieces: the engine's where it shards the parameters (ZeRO-3),
// else the module's parameters and buffers whole, replicated over `replicas`.
std::vector<parallel::StatePiece> model_pieces(parallel::Engine* engine, torch::nn::Module& model,
                                               const std::vector<int>& replicas) {
  std::vector<parallel::StatePiece> pieces;
  if (engine) pieces = engine->model_state();
  if (!pieces.empty()) return pieces;
  auto whole = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    pieces.push_back({name, t.detach(), t.sizes().vec(),
                      std::vector<int64_t>(static_cast<std::size_t>(t.dim()), 0), replicas});
  };
  for (const auto& it : model.named_parameters()) whole(it.key(), it.value());
  for (const auto& it : model.named_buffers()) whole(it.key(), it.value());
  return pieces;
}

// Adds `pieces` (boxes or flat ranges) to a save under `prefix`; returns their bytes.
int64_t add_pieces(ck::SaveState& state, const std::string& prefix,
                   const std::vector<parallel::StatePiece>& pieces) {
  int64_t bytes = 0;
  for (const auto& piece : pieces) {
    const std::string name = prefix + piece.name;
    if (piece.flat_begin >= 0) {
      state.add_flat_shard(name, piece.tensor, piece.global_shape, piece.flat_begin,
                           piece.replicas);
    } else {
      state.add_shard(name, piece.tensor, piece.global_shape, piece.offsets, piece.replicas);
    }
    bytes += static_cast<int64_t>(piece.tensor.nbytes());
  }
  return bytes;
}

// What fills `pieces` from a checkpoint under `prefix` (a flat range through the boxes it covers).
std::vector<ck::LoadTarget> load_targets(const std::string& prefix,
                                         const std::vector<parallel::StatePiece>& pieces) {
  std::vector<ck::LoadTarget> targets;
  for (const auto& piece : pieces) {
    const std::string name = prefix + piece.name;
    if (piece.flat_begin < 0) {
      targets.push_back(ck::LoadTarget{name, piece.tensor, piece.offsets});
      continue;
    }
    for (auto& t : ck::flat_load_targets(name, piece.tensor, piece.global_shape, piece.flat_begin))
      targets.push_back(std::move(t));
  }
  return targets;
}

namespace tensor = parallel::tensor;

// The tp layout of the parameter a piece belongs to: the parameter's own ("<param>") or that of
// its optimizer state ("<param>.<state>"); null for whole, replicated tensors.
const tensor::ParamLayout* split_layout(const std::map<std::string, tensor::ParamLayout>& layouts,
                                        const parallel::StatePiece& piece) {
  if (piece.tensor.dim() == 0) return nullptr;  // per-parameter scalars are the same everywhere
  auto it = layouts.find(piece.name);
  if (it == layouts.end()) {
    const auto dot = piece.name.rfind('.');
    if (dot != std::string::npos) it = layouts.find(piece.name.substr(0, dot));
  }
  return it == layouts.end() ? nullptr : &it->second;
}

// The boxes of the whole (single-process) tensor that `p`, a piece of a tp-split tensor, holds,
// each with a view of the piece's tensor: a whole local tensor gives one box per fused part
// (tensor::split_boxes); a flat range of it (ZeRO) first gives the boxes of the range in the local
// tensor (parallel::flat_range_boxes), each then cut at the part boundaries (the split dimension of
// a fused layer is 0, and a contiguous box of several rows spans whole trailing dimensions, so
// every cut stays contiguous) and moved to where that part's rows sit in the whole tensor.
std::vector<tensor::SplitBox> split_piece_boxes(const parallel::StatePiece& p,
                                                const tensor::ParamLayout& l) {
  if (p.flat_begin < 0) return tensor::split_boxes(p.tensor, l);
  const std::vector<int64_t>& local = p.global_shape;  // an engine's pieces are of the local tensor
  const auto d = static_cast<std::size_t>(l.dim);
  const int64_t per_part = local.at(d) / l.parts;
  std::vector<tensor::SplitBox> out;
  int64_t at = 0;
  for (const parallel::Box& b :
       parallel::flat_range_boxes(local, p.flat_begin, p.flat_begin + p.tensor.numel())) {
    const at::Tensor run = p.tensor.narrow(0, at, b.numel());
    at += b.numel();
    int64_t row = 0;  // along d, within the box
    while (row < b.lengths[d]) {
      const int64_t first = b.offsets[d] + row, k = first / per_part;
      const int64_t rows = std::min(b.lengths[d] - row, (k + 1) * per_part - first);
      std::vector<int64_t> lengths = b.lengths, offsets = b.offsets;
      lengths[d] = rows;
      offsets[d] = (k * l.size + l.rank) * per_part + (first - k * per_part);
      const int64_t inner = b.numel() / b.lengths[d];  // elements per unit of dimension d
      out.push_back({run.narrow(0, row * inner, rows * inner).view(lengths), offsets});
      row += rows;
    }
  }
  return out;
}

// Tensor parallel: pieces as a checkpoint stores them, in the single-process names and shapes so
// that any tp size loads them: each piece of a tp-split tensor (a whole local tensor, or a ZeRO
// rank's flat range of one) as the boxes of the whole tensor it holds, written by this rank
// (several pieces of one tensor per rank file: checkpoint/format.h, version 4); every other
// tensor is the same on all tp ranks, so its replica set grows by the tp peers.
std::vector<parallel::StatePiece> tp_save_pieces(
    std::vector<parallel::StatePiece> pieces,
    const std::map<std::string, tensor::ParamLayout>& layouts, const comm::Topology& topo) {
  const comm::Layout& layout = topo.layout();
  if (layout.tp == 1) return pieces;
  std::vector<parallel::StatePiece> out;
  for (auto& p : pieces) {
    const tensor::ParamLayout* l = split_layout(layouts, p);
    if (l == nullptr) {
      std::set<int> reps;
      for (int r : p.replicas)
        for (int q : comm::group_ranks(layout, "tp", r)) reps.insert(q);
      if (p.replicas.empty()) {
        for (int q : topo.tp()->world_ranks()) reps.insert(q);
      }
      p.replicas.assign(reps.begin(), reps.end());
      out.push_back(std::move(p));
      continue;
    }
    const std::vector<int64_t> whole =
        tensor::global_shape(p.flat_begin < 0 ? p.tensor.sizes().vec() : p.global_shape, *l);
    for (auto& box : split_piece_boxes(p, *l))
      out.push_back({p.name, box.local, whole, box.offsets, p.replicas});
  }
  return out;
}

// Load targets for pieces of a tensor-parallel model: a piece of a tp-split tensor reads the boxes
// of the whole tensor it holds (split_piece_boxes), from a checkpoint of any layout.
std::vector<ck::LoadTarget> tp_load_targets(
    const std::string& prefix, const std::vector<parallel::StatePiece>& pieces,
    const std::map<std::string, tensor::ParamLayout>& layouts) {
  std::vector<parallel::StatePiece> whole;
  std::vector<ck::LoadTarget> targets;
  for (const auto& p : pieces) {
    const tensor::ParamLayout* l = split_layout(layouts, p);
    if (l == nullptr) {
      whole.push_back(p);
      continue;
    }
    for (const auto& box : split_piece_boxes(p, *l))
      targets.push_back(ck::LoadTarget{prefix + p.name, box.local, box.offsets});
  }
  for (auto& t : load_targets(prefix, whole)) targets.push_back(std::move(t));
  return targets;
}

// "NaN", "inf" or "-inf" (the platform prints "-nan" for some NaNs).
std::string nonfinite_name(double v) {
  return std::isnan(v) ? "NaN" : (v > 0 ? "inf" : "-inf");
}

c10::Device pick_device(const TrainConfig& cfg, const comm::World& world) {
  const auto gpu = world.device();
  if (cfg.device == "cpu") return c10::Device(c10::kCPU);
  if (cfg.device == "cuda") {
    PARALLAX_CHECK(
        gpu.has_value(), ConfigError,
        "key 'train.device' is 'cuda' but rank {} sees no CUDA device (LibTorch CUDA: {})",
        world.rank(), at::hasCUDA() ? "yes" : "no");
    return *gpu;
  }
  return gpu.has_value() ? *gpu : c10::Device(c10::kCPU);
}

// Peak memory of this rank in GiB: the device allocator's peak on GPUs, peak RSS on the CPU.
double peak_memory_gb(const c10::Device& device) {
  if (device.is_cuda()) {
    const auto stats = at::accelerator::getDeviceStats(device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0 * 1024.0);
  }
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / (1024.0 * 1024.0);  // ru_maxrss is KiB on Linux
}

void run_plot_tool(const fs::path& run_dir) {
  const char* src = std::getenv("PARALLAX_SOURCE_DIR");
  const fs::path tool = fs::path(src ? src : PARALLAX_SOURCE_DIR) / "tools" / "plot_metrics.py";
  std::error_code ec;
  if (!fs::exists(tool, ec)) {
    core::log::warn("plots skipped: '{}' not found", tool.string());
    return;
  }
  const char* py = std::getenv("PARALLAX_PYTHON");
  const std::string cmd = fmt::format("'{}' '{}' '{}' 2>&1", py && *py ? py : PARALLAX_PYTHON_EXE,
                                      tool.string(), run_dir.string());
  std::string output;
  int rc = -1;
  if (std::FILE* pipe = popen(cmd.c_str(), "r")) {
    char buf[512];
    while (std::fgets(buf, sizeof(buf), pipe)) output += buf;
    rc = pclose(pipe);
  }
  if (rc != 0) {
    const std::string last = core::trim(
        output.substr(output.rfind('\n', output.size() >= 2 ? output.size() - 2 : 0) + 1));
    core::log::warn("plots skipped: '{}' failed: {}", cmd, last.empty() ? "no output" : last);
  } else {
    core::log::info("plots: {}", (run_dir / "plots").string());
  }
}

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
  // Tensor parallel: this rank's slices of `dense` (the same model built for one process).
  void copy_dense_into_split(models::Model& dense);
  // The model's checkpoint pieces (model_pieces) that TrainerHooks::saves_model_tensor keeps.
  std::vector<parallel::StatePiece> checkpointed_model(const std::vector<int>& replicas) const;
  // train.cuda_graph: refuses what a captured step cannot do, naming the key (the model's own
  // blockers are checked once it is built).
  void check_graph_capturable() const;

  RunConfig& cfg_;
  TrainerHooks hooks_;
  comm::World& world_;
  c10::Device device_{c10::kCPU};
  comm::CommPtr world_comm_;
  std::unique_ptr<comm::Topology> topo_;
  // Tensor parallel (tp > 1): the model's tp group and how its layers split each parameter.
  tensor::TpPtr tp_;
  std::map<std::string, tensor::ParamLayout> tp_layouts_;
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
  std::unique_ptr<BatchSource> source_;
  std::unique_ptr<ck::Checkpointer> checkpointer_;
  std::unique_ptr<ck::CheckpointReader> resume_;  // open only during setup
  std::vector<ck::ConfigChange> config_changes_;  // vs the resumed checkpoint's config
  int64_t start_step_ = 0;
  bool resumed_ = false;  // a checkpoint was loaded (its step may be 0: a ptq run)
  bool eval_preempted_ = false;  // run_eval() stopped for preemption: stop after saving
  bool model_tensors_logged_ = false;
  bool synthetic_ = true;
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

void TrainerImpl::replay_or_abort(const std::function<void()>& launch) {
  try {
    launch();
  } catch (const TimeoutError& e) {
    std::fprintf(stderr, "parallax: error: %s\n", e.what());
    world_.abort(1);
  }
}

void TrainerImpl::check_graph_capturable() const {
  const auto& p = cfg_.parallel;
  PARALLAX_CHECK(
      device_.is_cuda(), ConfigError,
      "key 'train.cuda_graph': CUDA graphs need a GPU, but rank {} trains on {} (train.device={})",
      world_.rank(), device_.str(), cfg_.train.device);
  PARALLAX_CHECK(
      cfg_.precision.mode != "fp16", ConfigError,
      "key 'train.cuda_graph': precision.mode=fp16's dynamic loss scaler decides on the host "
      "whether a "
      "step is skipped, which a captured step cannot do; use precision.mode=bf16 or fp32");
  PARALLAX_CHECK(!p.ddp.find_unused, ConfigError,
                 "key 'train.cuda_graph': parallel.ddp.find_unused reads which parameters got "
                 "gradients on the host "
                 "every step; set parallel.ddp.find_unused=false");
  PARALLAX_CHECK(
      !p.debug_collectives, ConfigError,
      "key 'train.cuda_graph': parallel.debug_collectives cross-checks every collective on the "
      "host "
      "before it runs; set parallel.debug_collectives=false (or train.cuda_graph=false to debug)");
}

void TrainerImpl::compare_config(const std::string& config_text) {
  const std::string where = resume_->dir();
  const std::optional<std::string> saved = resume_->config_text();
  if (!saved) {
    // Saved before checkpoints kept their config: only the hash can tell.
    if (rank0_ && resume_->metadata().config_hash != core::stable_hash(config_text)) {
      core::log::warn(
          "resuming from {} (step {}): its config hash differs from this run's, and it was saved "
          "without its config, so the changed keys are unknown",
          where, start_step_);
    }
    return;
  }
  // train.resume is how a resume is asked for: it differs by nature.
  config_changes_ =
      ck::diff_configs(*saved, config_text, {"train.resume"},
                       fmt::format("'{}/{}'", where, ck::kConfigFile), "this run's config");
  if (rank0_ && !config_changes_.empty()) {
    core::log::warn(
        "resuming from step {} with a config that differs from the checkpoint's ({}/{}): {}",
        start_step_, where, ck::kConfigFile, ck::describe_changes(config_changes_));
  }
}

void TrainerImpl::with_config_hint(const std::vector<std::string>& prefixes,
                                   const std::function<void()>& load) const {
  try {
    load();
  } catch (const CheckpointError& e) {
    if (config_changes_.empty()) throw;
    auto suspects = ck::changes_under(config_changes_, prefixes);
    if (suspects.empty()) suspects = config_changes_;
    throw_error<CheckpointError>("{}; config keys changed since the checkpoint was saved: {}",
                                 e.what(), ck::describe_changes(suspects));
  }
}

void TrainerImpl::check_resumed_state_finite() const {
  std::vector<std::pair<std::string, at::Tensor>> state;
  for (const auto& piece : model_pieces(engine_.get(), *model_, {}))
    state.emplace_back("model/" + piece.name, piece.tensor);
  for (const auto& [k, t] : engine_->optimizer().state()) state.emplace_back("optim/" + k, t);
  std::vector<at::Tensor> tensors;
  for (const auto& [k, t] : state) tensors.push_back(t.detach());
  const int64_t bad = ck::first_nonfinite(tensors, /*parallel=*/true);
  if (bad < 0) return;
  const auto count = ck::count_nonfinite(tensors[static_cast<std::size_t>(bad)]);
  throw_error<CheckpointError>(
      "checkpoint '{}' (step {}): tensor '{}' holds {} NaN and {} infinite value(s); "
      "resume from an earlier checkpoint (train.resume=<its path>)",
      resume_->dir(), start_step_, state[static_cast<std::size_t>(bad)].first, count.nan,
      count.inf);
}

void TrainerImpl::setup() {
  device_ = pick_device(cfg_.train, world_);
  // Ranks sharing a node share its cores: without this, every rank would start one intra-op
  // thread per core and they would all fight over them.
  const int local_ranks = std::max(1, world_.launch().local_world_size);
  const int threads =
      cfg_.train.threads > 0
          ? cfg_.train.threads
          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / local_ranks);
  at::set_num_threads(threads);
  const auto& p = cfg_.parallel;
  comm::CommOptions opts = comm::make_comm_options(
      p.timeout_s, p.init_timeout_s, p.checkpoint_timeout_s, p.debug_collectives,
      p.flight_recorder_size, p.allreduce, static_cast<int64_t>(p.ring_chunk_mb * (1 << 20)));
  opts.nccl_blocking = p.nccl_blocking;
  std::string backend = p.backend;
  if (backend == "auto" && device_.is_cpu()) backend = world_.has_mpi() ? "mpi" : "gloo";
  world_comm_ = comm::make_world_communicator(world_, backend, opts);
  PARALLAX_CHECK(
      device_.is_cpu() == (world_comm_->device_type() == c10::kCPU), ConfigError,
      "key 'parallel.backend': backend '{}' works on {} tensors but the model runs on {}",
      world_comm_->backend(), c10::DeviceTypeName(world_comm_->device_type()), device_.str());
  const int gpus =
      p.gpus_per_node > 0 ? p.gpus_per_node : (device_.is_cuda() ? world_.cuda_device_count() : 0);
  plan_ = parallel::Plan::from(p, cfg_.train.activation_checkpointing, cfg_.train.cuda_graph,
                               world_.size(), gpus);
  const comm::Layout layout = plan_.layout;
  // First collective on world_comm_: rank 0 checks, creates and locks the run directory for the
  // whole run, and every rank learns the outcome (a second job on it fails here on every rank).
  run_directory_.emplace(RunDirectory::open(cfg_.experiment, *world_comm_, device_));
  run_dir_ = run_directory_->path();
  topo_ = std::make_unique<comm::Topology>(world_comm_, layout);
  rank0_ = world_.rank() == 0;
  world_.set_report_dir(run_dir_.string());  // hang reports (flight recorder JSON) go with the run
  // Resume: the checkpoint's metadata says where training and the data stream continue. Every
  // rank chooses (train.resume=auto: `latest`, or the newest step that verifies when `latest` is
  // lost or names a broken step) and opens it; the ranks agree on the outcome and on the step
  // before any further collective.
  const fs::path ckpt_dir = run_dir_ / "checkpoints";
  const std::string config_text = resolved_yaml(cfg_);
  const std::vector<int64_t> steps = comm::agree_on(
      *world_comm_, device_, "resume: choosing and opening the checkpoint",
      [&]() -> int64_t {
        const auto point = ck::find_resume_point(cfg_.train.resume, ckpt_dir.string());
        if (!point) {
          if (cfg_.train.resume == "auto")
            core::log::info("train.resume=auto: no checkpoint in {}, starting fresh",
                            ckpt_dir.string());
          return -1;
        }
        if (rank0_) {
          for (const std::string& w : point->warnings) core::log::warn("{}", w);
        }
        resume_ = std::make_unique<ck::CheckpointReader>(point->path);
        resumed_ = true;
        start_step_ = resume_->metadata().step;
        core::log::info("resuming from {} (step {}, saved with layout {})", point->path,
                        start_step_, resume_->metadata().layout.to_string());
        compare_config(config_text);
        return start_step_;
      });
  if (std::any_of(steps.begin(), steps.end(), [&](int64_t t) { return t != steps[0]; })) {
    std::vector<std::string> seen;
    for (std::size_t r = 0; r < steps.size(); ++r) {
      seen.push_back(steps[r] < 0 ? fmt::format("rank {}: none", r)
                                  : fmt::format("rank {}: step {}", r, steps[r]));
    }
    throw_error<CheckpointError>(
        "resume: the ranks disagree on the checkpoint to resume from in '{}' ({}): every rank "
        "must see the same run directory (experiment.output_dir on a shared filesystem)",
        ckpt_dir.string(), core::join(seen, ", "));
  }
  core::log::info(
      "run directory: {} | {} rank(s), layout {}, backend {}, device {}, {} CPU thread(s) per rank",
      run_dir_.string(), world_.size(), layout.to_string(), world_comm_->backend(), device_.str(),
      threads);

  // Where the data stream continues; the sources remap it when dp changed (batch_source.h).
  std::pair<int64_t, int64_t> data_pos{0, 0};
  int data_pos_dp = 0;
  if (resume_ && resume_->metadata().has_extra("data.epoch")) {
    data_pos = {resume_->metadata().extra_int("data.epoch"),
                resume_->metadata().extra_int("data.position")};
    data_pos_dp = resume_->metadata().layout.dp;
  }

  // Data first: a dataset's dataset.json describes the scenes the model is built for.
  const uint64_t seed = static_cast<uint64_t>(cfg_.experiment.seed);
  synthetic_ = uses_synthetic_data(cfg_);
  if (!synthetic_) {
    source_ =
        make_dataset_source(cfg_.data, seed, topo_->coord().dp, layout.dp, data_pos, data_pos_dp);
    scene_ = *source_->scene();  // the dataset's, as run_scene() reads it
  } else {
    // Synthetic bev batches use the size's benchmark scene (tiny: the default 6 x 128x224 scene;
    // small and up: BEVFormer's 6 x 256x704 cameras and 200 x 200 BEV cells at 0.5 m).
    scene_ = run_scene(cfg_);
  }
  if (cfg_.train.cuda_graph) {
    check_graph_capturable();
    // From here on the training thread runs on the graph's side stream, before anything autograd
    // will use is built: a parameter's gradient accumulator (made by DDP's constructor or the
    // first backward) runs on the stream current when it was made, and the legacy default stream
    // cannot take part in a capture (PyTorch asks the same: DDP built in a side-stream context).
    graph_ = std::make_unique<CudaStepGraph>(device_, world_.rank(), cfg_.parallel.timeout_s);
  }
  // Identical initialisation on every rank (DDP also broadcasts from rank 0).
  core::seed_all(seed);
  if (layout.pp > 1) {
    for (const auto& [on, key, what] :
         {std::make_tuple(cfg_.lora.rank > 0, "lora.rank", "LoRA"),
          std::make_tuple(cfg_.qat.enabled, "qat.enabled", "QAT"),
          std::make_tuple(!cfg_.distill.teacher.empty(), "distill.teacher", "distillation")}) {
      PARALLAX_CHECK(!on, ConfigError,
                     "keys '{}' and 'parallel.pp': the {} trainer does not run under pipeline "
                     "parallelism in this version; use parallel.pp=1 (data, tensor parallel or "
                     "ZeRO)",
                     key, what);
    }
  }
  // Plan step 1: tensor-parallel layers come from the model's factory.
  if (layout.tp > 1) {
    PARALLAX_CHECK(cfg_.lora.rank == 0, ConfigError,
                   "keys 'lora.rank' and 'parallel.tp': LoRA adapts dense linear layers and "
                   "parallel.tp={} makes them column/row-parallel; use parallel.tp=1 (data "
                   "parallel or ZeRO) for LoRA in this version",
                   layout.tp);
    PARALLAX_CHECK(!cfg_.qat.enabled, ConfigError,
                   "keys 'qat.enabled' and 'parallel.tp': QAT quantizes dense linear layers and "
                   "parallel.tp={} makes them column/row-parallel; use parallel.tp=1 (data "
                   "parallel or ZeRO) for QAT in this version",
                   layout.tp);
    tp_ = std::make_shared<tensor::TpGroup>(topo_->tp(), plan_.sequence_parallel);
    model_ = models::build_model(cfg_.model, scene_, tp_);
    tp_layouts_ = tensor::param_layouts(*model_);
  } else {
    model_ = models::build_model(cfg_.model, scene_);
  }
  model_->to(device_);
  model_->train();
  double load_s = 0;  // checkpoint read time: the weights here, the optimizer state below
  // Pretrained weights go into the model as built; the transform (e.g. LoRA adapters, QAT
  // observers) comes after them, and a resumed checkpoint, saved from the transformed model, is
  // loaded after the transform. A checkpoint that holds only some model tensors
  // (TrainerHooks::saves_model_tensor, e.g. LoRA's adapters) needs these weights on resume too.
  if ((!resume_ || hooks_.saves_model_tensor) && !cfg_.train.load_from.empty()) {
    // A NaN in the loaded weights would only show as a NaN loss at step 1 ("lower optim.lr"):
    // named here, at load time. LoRA checks its base itself (naming it as the LoRA base).
    auto require_finite_load = [&](const torch::nn::Module& m) {
      if (cfg_.lora.rank > 0) return;
      ck::require_finite(m, fmt::format("train.load_from '{}'", cfg_.train.load_from),
                         "point train.load_from at an earlier checkpoint");
    };
    ck::WeightsOptions w;
    w.strict = cfg_.train.strict_load;
    if (tp_) {
      // Through a single-process copy of the model: each rank keeps its slices of it.
      auto dense = models::build_model(cfg_.model, scene_);
      const auto report = ck::load_weights(*dense, cfg_.train.load_from, w);
      core::log::info("train.load_from={}: {}", cfg_.train.load_from, report.summary());
      require_finite_load(*dense);
      copy_dense_into_split(*dense);
    } else {
      const auto report = ck::load_weights(*model_, cfg_.train.load_from, w);
      core::log::info("train.load_from={}: {}", cfg_.train.load_from, report.summary());
      require_finite_load(*model_);
    }
  }
  if (hooks_.transform_model) {
    hooks_.transform_model(*model_);
    model_->to(device_);  // parameters the transform added
  }
  // ZeRO-3 over several ranks reads each rank's shard of the model after the engine has sharded
  // it (below), so no rank reads the whole model from the checkpoint.
  const bool sharded_model = plan_.zero_stage == 3 && layout.dp > 1;
  if (resume_ && !sharded_model) {
    core::Stopwatch load_clock;
    // Each rank reads its part (tensor or pipeline parallelism: its slices); a rank that fails
    // alone must not leave the others in the engine's first collective (agree_on).
    comm::agree_on(
        *world_comm_, device_, fmt::format("resume from '{}': loading the model", resume_->dir()),
        [&]() -> int64_t {
          if (hooks_.saves_model_tensor || tp_) {
            with_config_hint({"model.", "lora.", "qat."}, [&] { load_model_pieces(); });
          } else {
            with_config_hint({"model.", "lora.", "qat."},
                             [&] { ck::load_weights(*resume_, *model_); });
          }
          return 0;
        });
    load_s += load_clock.elapsed_s();
  }
  if (hooks_.frozen_model) {
    frozen_ = hooks_.frozen_model(cfg_, scene_, device_);
    PARALLAX_CHECK(frozen_ != nullptr, Error, "TrainerHooks::frozen_model returned no model");
    frozen_->to(device_);
    frozen_->eval();
    for (auto& p : frozen_->parameters()) p.set_requires_grad(false);
  }
  core::log::info("model {}/{}: {:.3f} M parameters, {:.3f} GFLOP forward per sample",
                  cfg_.model.name, cfg_.model.size, model_->parameter_count() / 1e6,
                  model_->forward_flops_per_sample() / 1e9);
  if (graph_) {
    const std::string blocker = model_->graph_capture_blocker();
    PARALLAX_CHECK(
        blocker.empty(), ConfigError,
        "key 'train.cuda_graph': model '{}' cannot be captured: {}; set train.cuda_graph=false",
        cfg_.model.name, blocker);
    core::log::info(
        "CUDA graph: {} eager warm-up step(s), then the whole step is captured and replayed",
        cfg_.train.cuda_graph_warmup);
  }

  if (cfg_.train.activation_checkpointing != "none") {
    int idx = 0, wrapped = 0;
    for (auto& block : model_->checkpointable_blocks()) {
      auto cb = std::dynamic_pointer_cast<models::CheckpointableBlock>(block);
      const bool on = models::checkpointed_block(cfg_.train.activation_checkpointing, idx);
      if (cb && on) {
        cb->set_checkpointing(true);
        ++wrapped;
      }
      ++idx;
    }
    core::log::info("activation checkpointing ({}): {} of {} blocks",
                    cfg_.train.activation_checkpointing, wrapped, idx);
  }

  // Plan step 4 (parallel/plan.h): DDP or ZeRO over the data-parallel group, last, on the
  // parameters in their final form (steps 1 and 3, TP and PP, are not available yet; step 2,
  // activation checkpointing, is above).
  parallel::ddp::DdpOptions o;
  o.mode = parallel::ddp::parse_bucket_mode(p.ddp.bucket_mode);
  o.reduce_dtype = parallel::ddp::parse_reduce_dtype(p.ddp.reduce_dtype);
  o.bucket_mb = p.ddp.bucket_mb;
  o.first_bucket_mb = p.ddp.first_bucket_mb;
  o.find_unused = p.ddp.find_unused;
  o.broadcast_buffers = p.ddp.broadcast_buffers;
  o.algo = comm::parse_allreduce_algo(p.allreduce);
  o.timing = !cfg_.train.cuda_graph;
  // Sequence parallel: LayerNorm and row-bias gradients summed over tp as autograd makes them.
  tensor::install_sequence_parallel_hooks(tp_);
  parallel::TensorParallelInfo tp_info;
  if (tp_) {
    tp_info.tp = topo_->tp();
    for (const auto& [name, l] : tp_layouts_) tp_info.sharded.insert(name);
  }
  const optim::OptimConfig optim_cfg = cfg_.optim;
  const auto make_engine = [&] {
    // The trainable parameters as they are now (under pipeline parallelism: this rank's stages').
    optim::NamedParams trainable;
    for (const auto& item : model_->named_parameters())
      trainable.emplace_back(item.key(), item.value());
    return parallel::build_engine(
        plan_, model_, optim::make_param_groups(trainable, cfg_.optim.weight_decay),
        [optim_cfg](std::vector<optim::ParamGroup> groups) {
          return optim::build_optimizer(optim_cfg, std::move(groups));
        },
        topo_->dp(), o, model_->units(), tp_info);
  };
  if (layout.pp > 1) {
    // Plan step 3: this rank's stages of the model's chain of units; the other units' parameters
    // are released, and the data-parallel engine is built on the stage's parameters only.
    PARALLAX_CHECK(model_->chain_length() > 0, ConfigError,
                   "key 'parallel.pp': model '{}' does not expose its forward as a chain of "
                   "units, so it cannot be split into pipeline stages",
                   cfg_.model.name);
    const std::vector<models::Unit> units = model_->units();
    PARALLAX_CHECK(static_cast<int>(units.size()) == model_->chain_length(), Error,
                   "model '{}': {} units but a chain of {}", cfg_.model.name, units.size(),
                   model_->chain_length());
    // Stage balance (Model::stage_costs): FLOPs per unit, or parameters per unit.
    const std::vector<double> costs = model_->stage_costs();
    parallel::pipeline::PipelineOptions po;
    po.schedule = plan_.pp_schedule;
    po.virtual_stages = plan_.pp_virtual_stages;
    po.layout = plan_.pp_layout;
    // Second criterion: activation bytes per unit as this run keeps them (precision, device, tp,
    // checkpointing), which `parallax plan` predicts from the same function.
    models::ActivationQuery q;
    q.compute_bytes = cfg_.precision.mode == "fp32" ? 4 : 2;
    q.cuda = device_.is_cuda();
    q.tp = layout.tp;
    q.sequence_parallel = plan_.sequence_parallel && layout.tp > 1;
    po.activation_bytes = model_->saved_activations(q, cfg_.train.activation_checkpointing);
    engine_ = std::make_unique<parallel::pipeline::PipelineEngine>(
        model_, units, costs, topo_->pp(), cfg_.train.grad_accum, po,
        [&]() -> std::unique_ptr<parallel::Engine> { return make_engine(); });
  } else {
    engine_ = make_engine();
  }
  // ZeRO-3 gathers and frees parameters around each unit of the model's forward.
  model_->set_unit_hooks(engine_->unit_hooks());
  core::log::info("parallel plan: {}; engine: {}", plan_.describe(), engine_->describe());
  if (layout.dp > 1) {
    // Loss normalisers over the replicas (Model::set_replica_mean). Asynchronous on GPUs: the
    // compute stream waits for the small all-reduce, the host does not.
    const comm::CommPtr dp = topo_->dp();
    const c10::Device at_device = dp->device_type() == c10::kCPU ? c10::Device(c10::kCPU) : device_;
    replica_mean_ = [dp, at_device](const at::Tensor& t) {
      at::Tensor x =
          t.detach().to(at_device, at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
      const comm::WorkPtr w = dp->all_reduce_async(x, comm::ReduceOp::kAvg);
      w->wait_stream();
      return x.device() == t.device() ? x : x.to(t.device());
    };
  }

  precision_ = optim::make_precision_policy(cfg_.precision, device_.type());
  scaler_ = std::make_unique<optim::LossScaler>(optim::make_loss_scaler(cfg_.precision));
  if (graph_) engine_->optimizer().set_capturable(device_);

  if (synthetic_) {
    // Each data-parallel rank holds its slice of every global batch.
    source_ = make_synthetic_source(*model_, cfg_.data.batch_size, 8, core::derive_seed(seed, 0, 1),
                                    topo_->coord().dp, device_, data_pos.second);
  }
  core::log::info("data: {}", source_->describe());

  if (resume_) {
    core::Stopwatch load_clock;
    // Each rank reads its own pieces (ZeRO: its flat ranges; ZeRO-3 over several ranks: its shard
    // of the model too), which only it checks: the ranks agree on the outcome before any further
    // collective (agree_on), so a corrupt shard is one error on every rank, not a hang.
    comm::agree_on(
        *world_comm_, device_,
        fmt::format("resume from '{}': loading the {}optimizer state", resume_->dir(),
                    sharded_model ? "model and " : ""),
        [&]() -> int64_t {
          if (sharded_model)
            with_config_hint({"model.", "lora.", "qat."}, [&] { load_model_pieces(); });
          with_config_hint({"optim.", "model.", "lora.", "qat."}, [&] { load_optimizer_state(); });
          check_resumed_state_finite();
          ck::load_loss_scaler(resume_->metadata(), *scaler_);
          if (hooks_.load_extra) hooks_.load_extra(*resume_);
          // Last: everything above may have drawn random numbers.
          if (!ck::load_rng(*resume_, world_.rank())) {
            core::log::warn(
                "checkpoint has no RNG state for rank {} (saved with {} ranks): RNG reseeded",
                world_.rank(), resume_->metadata().world);
          }
          return 0;
        });
    // Every tensor of a replicated (DDP) checkpoint is read by every rank.
    int64_t bytes = 0;
    for (const auto& [name, info] : resume_->metadata().tensors) bytes += info.nbytes();
    load_s += load_clock.elapsed_s();
    core::log::info("checkpoint loaded: {:.2f} GB in {:.2f} s on rank {} ({:.2f} GB/s)",
                    bytes / 1e9, load_s, world_.rank(), bytes / 1e9 / load_s);
    resume_.reset();
  }
  if (!cfg_.train.benchmark) {
    ck::CheckpointerOptions o;
    o.keep_last = cfg_.checkpoint.keep_last;
    o.async = cfg_.checkpoint.async;
    o.timeout_s = cfg_.parallel.checkpoint_timeout_s;
    o.config_hash = core::stable_hash(config_text);
    o.config_text = config_text;
    o.layout = layout;
    checkpointer_ = std::make_unique<ck::Checkpointer>(ckpt_dir.string(), o);
  }
  // Last, once the run is known to start: a resume that fails to load changes nothing on disk.
  open_run_directory(config_text);
}

void TrainerImpl::open_run_directory(const std::string& config_text) {
  if (!rank0_) {
    metrics_ = std::make_unique<MetricsWriter>();
    return;
  }
  // The directory exists: RunDirectory::open created and locked it.
  const std::string archived = ck::record_config(run_dir_.string(), config_text, start_step_);
  if (!archived.empty())
    core::log::info("config.yaml: the previous config is kept as {}", archived);
  // Rows of steps after start_step_ were logged by a run killed after its last checkpoint: this
  // run logs them again (metrics.h).
  const std::string metrics_path = (run_dir_ / "metrics.jsonl").string();
  const MetricsTrim trim = trim_metrics(metrics_path, start_step_);
  if (trim.dropped + trim.broken > 0) {
    core::log::info(
        "{}: kept {} row(s) up to step {}, dropped {} later or summary row(s) and {} torn line(s)",
        metrics_path, trim.kept, start_step_, trim.dropped, trim.broken);
  }
  metrics_ = std::make_unique<MetricsWriter>(metrics_path);
}

std::map<std::string, at::Tensor> TrainerImpl::train_step(int64_t step, double lr, bool log_step) {
  if (graph_) return graph_step(step, lr, log_step);
  auto terms = compute_step(
      [&](int) {
        core::Stopwatch data_clock;
        core::TensorDict batch = core::to_device(source_->next(), device_);
        data_ms_ += data_clock.elapsed_ms();
        return batch;
      },
      lr, log_step);
  // Drop the gradients (PyTorch's zero_grad default): the next backward writes each one once
  // instead of filling zeros and accumulating into them. Under DDP with flat buckets
  // the first gradients of a step are then copied into their bucket (one multi-tensor copy per
  // bucket) and become the bucket views again, as PyTorch's reducer does with
  // gradient_as_bucket_view: half the bytes of a zero fill plus an accumulate. With grouped
  // buckets the new gradients are reduced where autograd wrote them.
  // The first step of a fresh run records what every rank's engine holds with the gradients still
  // there (a resumed run's rows continue the first run's).
  if (step == 1 && start_step_ == 0) record_engine_memory(step);
  engine_->zero_grad();
  return terms;
}

void TrainerImpl::copy_dense_into_split(models::Model& dense) {
  at::NoGradGuard no_grad;
  const auto from = dense.named_parameters();
  for (auto& item : model_->named_parameters()) {
    const at::Tensor* src = from.find(item.key());
    PARALLAX_CHECK(src != nullptr, Error, "tensor parallel: '{}' has no single-process twin",
                   item.key());
    const auto it = tp_layouts_.find(item.key());
    if (it == tp_layouts_.end()) {
      item.value().copy_(*src);
      continue;
    }
    for (const auto& box : tensor::split_boxes(item.value(), it->second)) {
      at::Tensor part = *src;
      for (int64_t d = 0; d < box.local.dim(); ++d)
        part = part.narrow(d, box.offsets[static_cast<std::size_t>(d)], box.local.size(d));
      box.local.copy_(part);
    }
  }
  const auto buffers = dense.named_buffers();
  for (auto& item : model_->named_buffers()) {
    if (const at::Tensor* src = buffers.find(item.key())) item.value().copy_(*src);
  }
}

void TrainerImpl::load_model_pieces() {
  // This rank's flat range of every parameter (and the buffers, whole), from whatever shards of
  // whatever layout overlap them; or, before the engine exists, the module's tensors whole. Only
  // the tensors checkpoints hold (TrainerHooks::saves_model_tensor).
  resume_->load(tp_load_targets(ck::kModelPrefix, checkpointed_model({}), tp_layouts_));
}

std::vector<parallel::StatePiece> TrainerImpl::checkpointed_model(
    const std::vector<int>& replicas) const {
  std::vector<parallel::StatePiece> pieces = model_pieces(engine_.get(), *model_, replicas);
  if (hooks_.saves_model_tensor) {
    pieces.erase(std::remove_if(pieces.begin(), pieces.end(),
                                [&](const parallel::StatePiece& p) {
                                  return !hooks_.saves_model_tensor(p.name);
                                }),
                 pieces.end());
  }
  return pieces;
}

void TrainerImpl::load_optimizer_state() {
  // Each rank reads exactly the pieces it holds (a ZeRO rank: one flat range of each state tensor,
  // read as the boxes it covers), from whatever shards of whatever layout overlap them.
  resume_->load(tp_load_targets(ck::kOptimPrefix, engine_->optimizer_state(), tp_layouts_));
  engine_->optimizer_state_loaded();
}

void TrainerImpl::stage_graph_inputs(int64_t step) {
  // This step's batches go into the captured input buffers (stream-ordered after the last replay
  // that read them); the first step allocates them.
  for (int micro = 0; micro < cfg_.train.grad_accum; ++micro) {
    core::Stopwatch data_clock;
    core::TensorDict batch = core::to_device(source_->next(), device_);
    if (graph_inputs_.size() <= static_cast<std::size_t>(micro)) {
      core::TensorDict copy;
      for (const auto& [k, v] : batch) copy.emplace(k, v.defined() ? v.clone() : v);
      graph_inputs_.push_back(std::move(copy));
    } else {
      at::NoGradGuard no_grad;
      for (auto& [k, dst] : graph_inputs_[static_cast<std::size_t>(micro)]) {
        const auto it = batch.find(k);
        PARALLAX_CHECK(it != batch.end() && it->second.defined() == dst.defined() &&
                           (!dst.defined() || it->second.sizes() == dst.sizes()),
                       DataError,
                       "train.cuda_graph: step {} micro-batch {}: batch key '{}' has shape {} but "
                       "the captured step "
                       "was built for {}; a CUDA graph replays fixed shapes (every batch must be "
                       "full and alike)",
                       step, micro, k,
                       it == batch.end() || !it->second.defined()
                           ? "none"
                           : fmt::format("{}", it->second.sizes()),
                       dst.defined() ? fmt::format("{}", dst.sizes()) : "none");
        if (dst.defined()) dst.copy_(it->second, /*non_blocking=*/true);
      }
    }
    data_ms_ += data_clock.elapsed_ms();
  }
}

std::map<std::string, at::Tensor> TrainerImpl::graph_step(int64_t step, double lr, bool log_step) {
  stage_graph_inputs(step);
  // Buffers are broadcast once per step, before the graph (a blocking broadcast cannot be
  // captured).
  engine_->broadcast_buffers();
  engine_->optimizer().set_lr(lr);
  const auto inputs = [this](int micro) { return graph_inputs_[static_cast<std::size_t>(micro)]; };
  if (step - start_step_ <= cfg_.train.cuda_graph_warmup) {
    // Warm-up: the same step eagerly, on the side stream and with the device learning rate.
    auto terms = compute_step(inputs, lr, log_step);
    engine_->zero_grad();
    engine_->optimizer().count_step();
    return terms;
  }
  if (!graph_->captured()) {
    // The gradients are allocated by the captured backward (from the graph's memory pool) and stay
    // the graph's: replays overwrite them, nothing sets them to None.
    engine_->zero_grad();
    core::Stopwatch capture_clock;
    try {
      graph_->capture([&] { graph_terms_ = compute_step(inputs, lr, /*log_step=*/false); });
    } catch (const std::exception& e) {
      throw_error<Error>(
          "train.cuda_graph: capturing step {} on rank {} failed: {} (something in the step "
          "synchronises with the host or changes shape; set train.cuda_graph=false)",
          step, world_.rank(), e.what());
    }
    core::log::info("CUDA graph: step {} captured in {:.2f} s", step, capture_clock.elapsed_s());
  }
  replay_or_abort([&] { graph_->replay(step); });
  engine_->optimizer().count_step();
  if (log_step && cfg_.optim.grad_clip <= 0) {
    // Without clipping the norm is only a metric: computed eagerly from the replay's gradients.
    grad_norm_ = optim::clip_grad_norm(engine_->grads(), 0.0);
  }
  return graph_terms_;
}

std::map<std::string, at::Tensor> TrainerImpl::compute_step(
    const std::function<core::TensorDict(int)>& batch_of, double lr, bool log_step) {
  const int accum = cfg_.train.grad_accum;
  // Loss normalisers over the whole data-parallel batch during the step only: evaluation runs a
  // different number of batches per rank and must not issue collectives.
  struct ReplicaMeanScope {
    models::Model& model;
    ReplicaMeanScope(models::Model& m, const models::ReplicaMean& mean) : model(m) {
      model.set_replica_mean(mean);
    }
    ~ReplicaMeanScope() { model.set_replica_mean({}); }
  } replica_mean_scope(*model_, replica_mean_);
  // One micro-batch's loss as the engine takes it: what the backward starts from, and the terms to
  // log, each divided by the micro-batch count so that the engine's sum over them is the mean.
  const auto micro_loss = [&](const models::LossOutput& loss) {
    parallel::MicroLoss m;
    m.terms["loss"] = loss.total.detach() / accum;
    for (const auto& [k, v] : loss.terms) m.terms["loss_" + k] = v.detach().to(at::kFloat) / accum;
    m.backprop = scaler_->scale_loss(loss.total / static_cast<double>(accum));
    return m;
  };
  // The model whole (forward_loss) and as its chain of units (begin / run / finish, for a
  // pipeline's stages): the engine runs the form it needs. graph_step broadcasts buffers once
  // before the graph.
  parallel::StepFns fns;
  fns.forward_loss = [&](int micro) {
    const core::TensorDict batch = batch_of(micro);
    models::LossOutput loss;
    {
      optim::AutocastGuard autocast(precision_);
      const auto pred = model_->forward(batch);
      loss = model_->loss(batch, pred);
      if (hooks_.task_loss_weight != 1.0) loss.total = loss.total * hooks_.task_loss_weight;
      if (hooks_.extra_loss) {
        // Extra terms (distillation against the frozen model, regularisers): added to the
        // total, logged as loss_<name>.
        for (auto& [name, term] : hooks_.extra_loss(batch, pred, frozen_.get())) {
          loss.total = loss.total + term;
          loss.terms[name] = term.detach();
        }
      }
    }
    return micro_loss(loss);
  };
  // Each stage reads its side inputs from the micro-batch: every rank of a pipeline draws the same
  // batches (the data stream follows the dp coordinate); later stages do not see the images. The
  // step's batches are drawn together, in order, at the first use.
  std::vector<core::TensorDict> whole_batches, side_batches;
  const auto chain_batch = [&](int micro, bool whole) -> const core::TensorDict& {
    if (whole_batches.empty()) {
      for (int i = 0; i < accum; ++i) whole_batches.push_back(batch_of(i));
      side_batches = whole_batches;
      for (auto& b : side_batches) b.erase("images");
    }
    return (whole ? whole_batches : side_batches).at(static_cast<std::size_t>(micro));
  };
  fns.begin = [&](int micro) {
    optim::AutocastGuard autocast(precision_);
    return model_->chain_begin(chain_batch(micro, true));
  };
  fns.run = [&](int micro, int first, int last, const std::vector<at::Tensor>& in) {
    optim::AutocastGuard autocast(precision_);
    return model_->run_chain(first, last, chain_batch(micro, first == 0), in);
  };
  fns.finish = [&](int micro, const std::vector<at::Tensor>& out) {
    const core::TensorDict& batch = chain_batch(micro, false);
    models::LossOutput loss;
    {
      optim::AutocastGuard autocast(precision_);
      loss = model_->loss(batch, model_->chain_end(batch, out));
      if (hooks_.task_loss_weight != 1.0) loss.total = loss.total * hooks_.task_loss_weight;
    }
    return micro_loss(loss);
  };
  std::map<std::string, at::Tensor> terms = engine_->step(accum, fns, /*sync_buffers=*/!graph_);
  comm_ms_ += engine_->last_exposed_comm_ms();
  backward_ms_ += engine_->last_backward_ms();

  // Each gradient group says which communicators it is sharded over: the inf check and the norm
  // count every element once (DDP: replicated; ZeRO: sharded over dp).
  const std::vector<optim::GradGroup> grads = engine_->grads();
  found_inf_ = scaler_->unscale_and_check(grads);
  // Without clipping the norm is only a metric: computing it every step took ~1.9 ms of host time
  // per profiled ViT-B step (a multi-tensor norm over ~150 gradients and a stack), at the end of
  // the step, where the GPU waits for the host (bench/NOTES.md lever 15).
  if (cfg_.optim.grad_clip > 0 || log_step) {
    grad_norm_ = optim::clip_grad_norm(grads, found_inf_ ? 0.0 : cfg_.optim.grad_clip);
  } else {
    grad_norm_ = at::Tensor();
  }
  if (!found_inf_) engine_->update(lr);
  scaler_->update(found_inf_);
  return terms;
}

// After the first step (gradients exist): what every rank's engine holds, as one metrics row of
// kind "memory" (params_r<i>, grads_r<i>, optimizer_r<i>, bytes), which `parallax plan` predicts
// exactly (tests/train/test_planner.py). Collective over the world.
void TrainerImpl::record_engine_memory(int64_t step) {
  const parallel::EngineMemory m = engine_->memory();
  const c10::Device dev =
      world_comm_->device_type() == c10::kCPU ? c10::Device(c10::kCPU) : device_;
  at::Tensor mine = at::tensor(std::vector<int64_t>{m.params, m.grads, m.optimizer}, at::kLong).to(dev);
  at::Tensor all = at::empty({3 * world_comm_->size()}, mine.options());
  world_comm_->all_gather_async(mine, all)->wait();
  const at::Tensor host = all.cpu();
  std::map<std::string, double> row;
  for (int r = 0; r < world_comm_->size(); ++r) {
    row[fmt::format("params_r{}", r)] = static_cast<double>(host[3 * r].item<int64_t>());
    row[fmt::format("grads_r{}", r)] = static_cast<double>(host[3 * r + 1].item<int64_t>());
    row[fmt::format("optimizer_r{}", r)] = static_cast<double>(host[3 * r + 2].item<int64_t>());
  }
  metrics_->write("memory", step, row);
}

void TrainerImpl::save_checkpoint(int64_t step) {
  if (!checkpointer_) return;
  // Rows of steps <= `step` reach the disk before this checkpoint can commit (and, async, before
  // the background commit starts): a run resumed from it finds every one of them (metrics.h).
  metrics_->sync();
  ck::SaveState state;
  // The model: whole and replicated, or (ZeRO-3) each rank's flat range of every parameter; only
  // the tensors the hooks keep (LoRA: the adapters).
  const int64_t model_bytes = add_pieces(
      state, ck::kModelPrefix,
      tp_save_pieces(checkpointed_model(engine_->model_replicas()), tp_layouts_, *topo_));
  if (hooks_.saves_model_tensor && !model_tensors_logged_) {
    core::log::info(
        "checkpoints hold {} of model tensors on this rank (what trains; the rest comes from the "
        "base)",
        core::human_bytes(static_cast<double>(model_bytes)));
    model_tensors_logged_ = true;
  }
  // The optimizer state per parameter under its global name and shape, as the engine holds it
  // (whole and replicated under DDP; one flat range of each parameter's state under ZeRO).
  add_pieces(state, ck::kOptimPrefix,
             tp_save_pieces(engine_->optimizer_state(), tp_layouts_, *topo_));
  ck::add_rng(state);
  ck::add_loss_scaler(state, *scaler_);
  if (hooks_.save_extra) hooks_.save_extra(state);
  const auto pos = source_->position();
  state.set_extra("data.epoch", pos.first);
  state.set_extra("data.position", pos.second);
  checkpointer_->save(step, state);
  if (const auto st = checkpointer_->last_save(); st && st->step == step) {
    core::log::info("checkpoint step {} committed: {} ({:.2f} s)", step, st->path, st->total_s);
  } else {
    core::log::info("checkpoint step {}: writing in the background", step);
  }
}

bool TrainerImpl::prepare() {
  // Parameters whole for the call (ZeRO-3), as for evaluation.
  std::map<std::string, double> m;
  {
    parallel::FullParams whole(*engine_);
    const TrainingStart start{*model_,
                              resumed_,
                              topo_->dp(),
                              device_,
                              [this] { return core::to_device(source_->next(), device_); },
                              [this](const core::TensorDict& batch) {
                                optim::AutocastGuard autocast(precision_);
                                return model_->forward(batch);
                              },
                              [this] {
                                if (synthetic_ || cfg_.model.name != "bev")
                                  return std::map<std::string, double>{};
                                return evaluate(*model_, cfg_.data, scene_,
                                                static_cast<uint64_t>(cfg_.experiment.seed),
                                                *topo_->dp(), device_, precision_);
                              },
                              rank0_ ? run_dir_.string() : std::string()};
    try {
      m = hooks_.prepare(start);
    } catch (const PreemptedError& e) {
      core::log::warn("{}", e.what());
      return false;
    }
  }
  // A resume's buffers (and the prepared ones) are the same on every rank; DDP's buffer broadcast
  // (parallel.ddp.broadcast_buffers) keeps them so.
  if (!m.empty()) metrics_->write("prepare", start_step_, m);
  return true;
}

void TrainerImpl::run_eval(int64_t step) {
  if (synthetic_ || cfg_.model.name != "bev") return;
  // Evaluation runs a different number of batches per rank: no collective may happen inside it,
  // so ZeRO-3's parameters are gathered whole for its duration.
  parallel::FullParams whole(*engine_);
  std::map<std::string, double> m;
  try {
    m = evaluate(*model_, cfg_.data, scene_, static_cast<uint64_t>(cfg_.experiment.seed),
                 *topo_->dp(), device_, precision_);
  } catch (const PreemptedError& e) {
    core::log::warn("{} (step {})", e.what(), step);
    eval_preempted_ = true;
    return;
  }
  metrics_->write("eval", step, m);
}

TrainSummary TrainerImpl::fit() {
  setup();
  if (hooks_.prepare && !prepare()) {
    // Preempted while preparing (QAT calibration): no step ran and nothing changed that a
    // checkpoint would hold; the same command starts over.
    mark_preempted();
    return TrainSummary{run_dir_.string(), start_step_, NAN, 0};
  }
  if (!hooks_.trains) {
    // No optimizer step (QAT's ptq mode): the model as prepared, evaluated and saved once.
    core::log::info("train.steps ignored: this trainer takes no optimizer step (step {})",
                    start_step_);
    run_eval(start_step_);
    save_checkpoint(start_step_);
    if (checkpointer_) checkpointer_->wait();
    if (eval_preempted_) {  // the calibrated model is saved; only its eval row is missing
      mark_preempted();
      return TrainSummary{run_dir_.string(), start_step_, NAN, 0};
    }
    metrics_->write("summary", start_step_, {{"loss", NAN}, {"samples_per_s", 0.0}});
    world_comm_->barrier();
    return TrainSummary{run_dir_.string(), start_step_, NAN, 0};
  }

  int64_t total = cfg_.train.steps;
  if (cfg_.train.epochs > 0) {
    PARALLAX_CHECK(
        source_->batches_per_epoch() > 0, ConfigError,
        "key 'train.epochs' needs a dataset (synthetic batches have no epochs); use train.steps");
    total = cfg_.train.epochs * source_->batches_per_epoch() / cfg_.train.grad_accum;
  }
  const int64_t global_batch =
      static_cast<int64_t>(cfg_.data.batch_size) * cfg_.train.grad_accum * topo_->layout().dp;
  const double flops_per_step =
      3.0 * model_->forward_flops_per_sample() * static_cast<double>(global_batch);
  core::log::info(
      "training {} steps: global batch {} ({} per rank x {} micro-steps x dp {}), precision {}",
      total, global_batch, cfg_.data.batch_size, cfg_.train.grad_accum, topo_->layout().dp,
      cfg_.precision.mode);

  core::Progress progress("step", total, 5.0);
  if (start_step_ > 0) progress.update(start_step_);
  core::Stopwatch run_clock, interval_clock;
  int64_t interval_steps = 0;
  double first_step_s = 0;
  // A resume at or past train.steps trains nothing: its summary row names the checkpoint's step and
  // no loss (null), rather than step 0.
  TrainSummary summary{run_dir_.string(), start_step_, NAN, 0};
  const comm::CommPtr& dp = topo_->dp();
  const c10::Device reduce_device =
      dp->device_type() == c10::kCPU ? c10::Device(c10::kCPU) : device_;

  if (start_step_ >= total) {
    core::log::info("checkpoint step {} >= train.steps {}: nothing to train", start_step_, total);
  }
  StepProfiler profiler(
      cfg_.train.profile_steps > 0 ? std::max(cfg_.train.profile_start, start_step_ + 1) : 0,
      cfg_.train.profile_steps, device_.is_cuda(),
      (run_dir_ / "profile" / fmt::format("trace_rank{}.json", world_.rank())).string());
  // Graceful preemption (train/preemption.h): every rank leaves the loop before the same step.
  std::optional<PreemptionVote> vote;
  if (PreemptionSignals::installed()) vote.emplace(*world_comm_, device_, cfg_.parallel.timeout_s);
  int64_t stopped_after = -1;  // the last step trained when the vote said stop
  for (int64_t step = start_step_ + 1; step <= total; ++step) {
    // An evaluation stopped by preemption was agreed by every rank: stop here too, with its step.
    if (eval_preempted_ || (vote && vote->should_stop())) {
      const int64_t done = step - 1;
      const bool saved = cfg_.checkpoint.every > 0 && done % cfg_.checkpoint.every == 0;
      if (done > start_step_ && !saved) save_checkpoint(done);
      stopped_after = done;
      break;
    }
    const double lr = optim::lr_at(cfg_.schedule, cfg_.optim.lr, step, total);
    const bool log_now = step % cfg_.train.log_every == 0 || step == total;
    profiler.before(step);
    auto terms = train_step(step, lr, log_now);
    profiler.after(step);
    ++interval_steps;
    if (checkpointer_) checkpointer_->poll();  // surfaces a failed background save
    if (step == start_step_ + 1) {
      first_step_s = run_clock.elapsed_s();
    }
    // A checkpoint of step S is saved after S's metrics rows (save_checkpoint makes them durable
    // first), so that resuming from S never loses nor repeats a row (metrics.h).
    const bool save_now =
        cfg_.checkpoint.every > 0 && step % cfg_.checkpoint.every == 0 && step != total;
    // On the CPU a finite-loss check is free; on GPUs it would sync every step, so it happens at
    // log steps (the error then names the interval).
    if (!log_now && device_.is_cpu()) {
      const double v = terms["loss"].item<double>();
      if (!std::isfinite(v)) {
        throw_error<NumericsError>(
            "loss is {} at step {} on rank {} (metrics so far are in {}); lower optim.lr "
            "or check the data",
            nonfinite_name(v), step, world_.rank(), (run_dir_ / "metrics.jsonl").string());
      }
    }
    if (!log_now) {
      if (cfg_.train.eval_every > 0 && step % cfg_.train.eval_every == 0) {
        run_eval(step);
        interval_clock.reset();  // evaluation time is not training time
        interval_steps = 0;
        data_ms_ = comm_ms_ = backward_ms_ = 0;
      }
      if (save_now) save_checkpoint(step);
      continue;
    }

    // Mean of every loss term over the data-parallel group (one small collective at log steps).
    std::vector<std::string> keys;
    std::vector<at::Tensor> vals;
    for (const auto& [k, v] : terms) {
      keys.push_back(k);
      vals.push_back(v.to(at::kFloat).reshape({1}));
    }
    at::Tensor packed = at::cat(vals).to(reduce_device);
    if (dp->size() > 1) dp->all_reduce(packed, comm::ReduceOp::kAvg);
    packed = packed.cpu();
    const double loss = packed[0].item<double>();  // "loss" sorts first
    if (!std::isfinite(loss)) {
      throw_error<NumericsError>(
          "loss is {} at step {} (data-parallel mean; last finite log is in {}); lower "
          "optim.lr or use precision.mode=bf16",
          nonfinite_name(loss), step, (run_dir_ / "metrics.jsonl").string());
    }
    const double interval_s = interval_clock.elapsed_s();
    const double step_ms = 1000.0 * interval_s / interval_steps;
    std::map<std::string, double> m;
    for (std::size_t i = 0; i < keys.size(); ++i)
      m[keys[i]] = packed[static_cast<int64_t>(i)].item<double>();
    m["lr"] = lr;
    m["grad_norm"] = grad_norm_.defined() ? grad_norm_.item<double>() : NAN;
    m["loss_scale"] = scaler_->scale();
    m["skipped_steps"] = static_cast<double>(scaler_->skipped_steps());
    m["step_ms"] = step_ms;
    m["data_ms"] = data_ms_ / interval_steps;
    // Not measured inside a CUDA graph (DDP's timing events cannot be captured).
    m["comm_exposed_ms"] = graph_ ? NAN : comm_ms_ / interval_steps;
    if (engine_->timed()) m["backward_ms"] = graph_ ? NAN : backward_ms_ / interval_steps;
    m["img_per_s"] = global_batch * 1000.0 / step_ms;
    m["mem_gb"] = peak_memory_gb(device_);
    m["mfu"] = device_.is_cuda() ? flops_per_step / (step_ms / 1000.0) /
                                       (peak_flops_per_gpu(cfg_.precision.mode) * world_.size())
                                 : NAN;
    metrics_->write("train", step, m);
    progress.update(step, fmt::format("loss {:.4f} | lr {:.2e} | {:.0f} ms/step | {:.1f} samples/s",
                                      loss, lr, step_ms, m["img_per_s"]));
    summary.steps = step;
    summary.final_loss = loss;
    data_ms_ = comm_ms_ = backward_ms_ = 0;
    interval_steps = 0;
    if (cfg_.train.eval_every > 0 && step % cfg_.train.eval_every == 0 && step != total)
      run_eval(step);
    interval_clock.reset();
    if (save_now) save_checkpoint(step);  // its blocking time counts in the next interval
  }
  vote.reset();
  if (stopped_after >= 0) {
    if (graph_) replay_or_abort([&] { graph_->drain(); });
    if (checkpointer_) checkpointer_->wait();
    mark_preempted();
    core::log::warn("preempted: stopped after step {} of {}{}", stopped_after, total,
                    checkpointer_ ? "; resume with train.resume=auto" : " (checkpointing is off)");
    return summary;
  }
  if (total > start_step_) {
    run_eval(total);
    save_checkpoint(total);
    if (eval_preempted_) {
      // The last step is saved; only the final evaluation's row is missing.
      if (graph_) replay_or_abort([&] { graph_->drain(); });
      if (checkpointer_) checkpointer_->wait();
      mark_preempted();
      core::log::warn("preempted during the final evaluation: step {} is saved", total);
      return summary;
    }
  }
  if (graph_) replay_or_abort([&] { graph_->drain(); });
  if (checkpointer_) checkpointer_->wait();
  const double run_s = run_clock.elapsed_s();
  const int64_t ran = total - start_step_;
  if (ran > 1)
    summary.samples_per_s = (ran - 1) * global_batch / std::max(1e-9, run_s - first_step_s);
  progress.finish(fmt::format("final loss {:.4f}, {:.1f} samples/s", summary.final_loss,
                              summary.samples_per_s));
  // The last record: tells followers (tools/tb_sidecar.py) the run is complete.
  metrics_->write(
      "summary", summary.steps,
      {{"loss", summary.final_loss}, {"samples_per_s", summary.samples_per_s}, {"wall_s", run_s}});
  world_comm_->barrier();
  if (rank0_) {
    core::log::info("metrics: {}", (run_dir_ / "metrics.jsonl").string());
    run_plot_tool(run_dir_);
  }
  return summary;
}

}  // namespace

struct Trainer::Impl {
  Impl(RunConfig& cfg, TrainerHooks hooks) : trainer(cfg, std::move(hooks)) {}
  TrainerImpl trainer;
};

Trainer::Trainer(RunConfig& cfg, TrainerHooks hooks)
    : impl_(std::make_unique<Impl>(cfg, std::move(hooks))) {}

Trainer::~Trainer() = default;

TrainSummary Trainer::fit() {
  return impl_->trainer.fit();
}

TrainSummary run_training(RunConfig& cfg) {
  // The LoRA, distillation and QAT trainers are the plain one with their hooks (train/lora.h,
  // train/distill.h, train/qat.h).
  const int trainers =
      (cfg.lora.rank > 0) + !cfg.distill.teacher.empty() + static_cast<int>(cfg.qat.enabled);
  PARALLAX_CHECK(trainers <= 1, ConfigError,
                 "keys 'qat.enabled', 'lora.rank' and 'distill.teacher': QAT, LoRA and "
                 "distillation are separate trainers in this version; set one of them (qat.enabled="
                 "{}, lora.rank={}, distill.teacher='{}')",
                 cfg.qat.enabled, cfg.lora.rank, cfg.distill.teacher);
  Trainer trainer(cfg, cfg.lora.rank > 0              ? lora::hooks(cfg)
                       : !cfg.distill.teacher.empty() ? distill::hooks(cfg)
                       : cfg.qat.enabled              ? qat::hooks(cfg)
                                                      : TrainerHooks{});
  return trainer.fit();
}

}  // namespace parallax::train
