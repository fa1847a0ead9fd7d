// build_run(): the order of a run's assembly (train/run.h says why each step comes where it
// does), the world, the data, the engine and the outputs (train/run_steps.h).
#include "checkpoint/checkpointer.h"
#include "checkpoint/config_record.h"
#include "comm/agree.h"
#include "comm/factory.h"
#include "comm/startup.h"
#include "comm/topology.h"
#include "comm/world.h"
#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "core/strings.h"
#include "data/loader.h"
#include "data/schema.h"
#include "models/model.h"
#include "parallel/engine.h"
#include "parallel/parallelize.h"
#include "parallel/tensor/tensor_parallel.h"
#include "train/batch_source.h"
#include "train/cuda_graph.h"
#include "train/extension.h"
#include "train/metrics.h"
#include "train/run_dir.h"
#include "train/run_steps.h"
#include "units/param_init.h"

#include <sched.h>

#include <charconv>
#include <cstdlib>
#include <fstream>
#include <thread>

namespace parallax::train {

namespace ck = checkpoint;

Run::Run(const RunConfig& c, Purpose p) : cfg(c), purpose(p) {}

Run::~Run() {
  // The engine owns the unit hooks installed in the model, and goes first.
  engine.reset();
  if (model) model->set_unit_hooks(nullptr);
}

bool Run::evaluates() const {
  return !synthetic && !no_eval_split && cfg.model.name == "bev";
}

namespace detail {
namespace {

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

// A field of /proc/self/status in MiB ("VmRSS", "VmHWM"); -1 where it cannot be read.
double proc_status_mib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  }
  return -1;
}

// Restarts the kernel's peak-resident count (VmHWM) at the current resident size; false where the
// kernel does not allow it.
bool reset_peak_resident() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

// train.cuda_graph: refuses what a captured step cannot do, naming the key (the model's own
// blockers are checked once it is built).
void check_graph_capturable(const Run& run) {
  const auto& p = run.cfg.parallel;
  PARALLAX_CHECK(
      run.device.is_cuda(), ConfigError,
      "key 'train.cuda_graph': CUDA graphs need a GPU, but rank {} trains on {} (train.device={})",
      run.world->rank(), run.device.str(), run.cfg.train.device);
  PARALLAX_CHECK(
      !run.precision.loss_scaling(), ConfigError,
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

}  // namespace

void require_fp8_device(const optim::PrecisionPolicy& precision, const c10::Device& device) {
  if (!precision.fp8()) return;
  const std::string blocker = kernels::fp8::fp8_device_blocker(device);
  PARALLAX_CHECK(blocker.empty(), ConfigError,
                 "key 'precision.mode': fp8 needs an NVIDIA GPU with FP8 tensor cores: {}; use "
                 "precision.mode=bf16",
                 blocker);
}

void open_device(Run& run) {
  run.world = &comm::World::current();
  run.device = pick_device(run.cfg.train, *run.world);
  run.rank0 = run.world->rank() == 0;
  // Ranks sharing a node share its cores: without this, every rank would start one intra-op
  // thread per core and they would all fight over them (intra_op_threads).
  run.threads = intra_op_threads(run.cfg.train.threads, run.world->launch().local_world_size);
  at::set_num_threads(run.threads);
}

void open_world(Run& run) {
  const comm::World& world = *run.world;
  const auto& p = run.cfg.parallel;
  comm::CommOptions opts =
      comm::make_comm_options(p.timeout_s, comm::startup_deadline_s(p.init_timeout_s, p.timeout_s),
                              p.checkpoint_timeout_s, p.debug_collectives, p.flight_recorder_size,
                              p.allreduce, static_cast<int64_t>(p.ring_chunk_mb * (1 << 20)));
  opts.nccl_blocking = p.nccl_blocking;
  std::string backend = p.backend;
  if (backend == "auto" && run.device.is_cpu()) backend = world.has_mpi() ? "mpi" : "gloo";
  run.world_comm = comm::make_world_communicator(*run.world, backend, opts);
  PARALLAX_CHECK(
      run.device.is_cpu() == (run.world_comm->device_type() == c10::kCPU), ConfigError,
      "key 'parallel.backend': backend '{}' works on {} tensors but the model runs on {}",
      run.world_comm->backend(), c10::DeviceTypeName(run.world_comm->device_type()),
      run.device.str());
}

void open_training_world(Run& run) {
  const auto& p = run.cfg.parallel;
  const comm::World& world = *run.world;
  const int gpus = p.gpus_per_node > 0 ? p.gpus_per_node
                                       : (run.device.is_cuda() ? world.cuda_device_count() : 0);
  run.plan =
      parallel::Plan::from(p, run.cfg.train.activation_checkpointing, run.cfg.train.cuda_graph,
                           world.size(), gpus, plan_transforms(run.cfg));
  // First collective on the world: rank 0 checks, creates and locks the run directory for the
  // whole run, and every rank learns the outcome (a second job on it fails here on every rank).
  run.run_directory = std::make_unique<RunDirectory>(RunDirectory::open(
      run.cfg.experiment, run.cfg.train.resume.empty(), *run.world_comm, run.device));
  run.dir = run.run_directory->path();
  run.topo = std::make_unique<comm::Topology>(run.world_comm, run.plan.layout);
  run.world->set_report_dir(run.dir.string());  // hang reports go with the run
  RunConfig resolved = run.cfg;
  run.config_text = resolved_yaml(resolved);
  choose_resume(run);
  core::log::info(
      "run directory: {} | {} rank(s), layout {}, backend {}, device {}, {} CPU thread(s) per rank",
      run.dir.string(), world.size(), run.plan.layout.to_string(), run.world_comm->backend(),
      run.device.str(), run.threads);
}

void open_data(Run& run) {
  const RunConfig& cfg = run.cfg;
  run.synthetic = uses_synthetic_data(cfg);
  check_frames(cfg);
  if (run.purpose == Purpose::kEval) {
    // `parallax eval` evaluates a bev model on the dataset (it refuses anything else).
    run.scene = data::loader_scene_spec(data::read_dataset_info(cfg.data.path), cfg.data);
    return;
  }
  if (run.purpose != Purpose::kTrain || run.synthetic) {
    // Synthetic bev batches use the size's benchmark scene (tiny: the default 6 x 128x224 scene;
    // small and up: BEVFormer's 6 x 256x704 cameras and 200 x 200 BEV cells at 0.5 m).
    run.scene = run_scene(cfg);
    return;
  }
  // Where the data stream continues; the sources remap it when dp changed (batch_source.h).
  std::pair<int64_t, int64_t> pos{0, 0};
  int pos_dp = 0;
  if (run.resume && run.resume->metadata().has_extra("data.epoch")) {
    pos = {run.resume->metadata().extra_int("data.epoch"),
           run.resume->metadata().extra_int("data.position")};
    pos_dp = run.resume->metadata().layout.dp;
  }
  run.source = make_dataset_source(cfg.data, static_cast<uint64_t>(cfg.experiment.seed),
                                   run.topo->coord().dp, run.plan.layout.dp, pos, pos_dp);
  run.scene = *run.source->scene();  // the dataset's, as run_scene() reads it
  if (cfg.model.name != "bev") return;
  // Evaluation reads data.val_split: a dataset without it is found now, not after training.
  const data::DatasetInfo info = data::read_dataset_info(cfg.data.path);
  if (info.splits.count(cfg.data.val_split)) return;
  std::vector<std::string> names;
  for (const auto& [name, _] : info.splits) names.push_back(name);
  PARALLAX_CHECK(cfg.train.eval_every == 0, ConfigError,
                 "key 'data.val_split': dataset '{}' has no split '{}' (its splits: {}); "
                 "name one of them, or set train.eval_every=0 to train without evaluation",
                 cfg.data.path, cfg.data.val_split, core::join(names, ", "));
  core::log::warn(
      "dataset '{}' has no split '{}' (data.val_split; its splits: {}): no evaluation at the "
      "end of training",
      cfg.data.path, cfg.data.val_split, core::join(names, ", "));
  run.no_eval_split = true;
}

namespace {

// Step 5 (train): the plan applied to the model (tensor parallelism, recompute, pipeline stages,
// then DDP or ZeRO over the data-parallel group, with the optimizer: parallel/parallelize.h).
void build_engine(Run& run, const std::shared_ptr<units::DeferredInit>& recipes) {
  parallel::ParallelizeOptions po;
  po.model_name = run.cfg.model.name;
  po.micro_batches = run.cfg.train.grad_accum;
  po.optimizer = run.cfg.optim;
  po.layer_of = layer_of(*run.model);
  po.compute_bytes = run.precision.compute_bytes();
  po.cuda = run.device.is_cuda();
  po.deferred = recipes;
  run.engine = parallel::parallelize(*run.model, run.plan, *run.topo, run.tp, po);
  if (run.graph) run.engine->optimizer().set_capturable(run.device);
  if (run.synthetic) {
    // Each data-parallel rank holds its slice of every global batch.
    const int64_t position = run.resume && run.resume->metadata().has_extra("data.epoch")
                                 ? run.resume->metadata().extra_int("data.position")
                                 : 0;
    run.source = make_synthetic_source(
        *run.model, run.cfg.data.batch_size, 8,
        core::derive_seed(static_cast<uint64_t>(run.cfg.experiment.seed), 0, 1),
        run.topo->coord().dp, run.device, position);
  }
  core::log::info("data: {}", run.source->describe());
}

// Step 6 (train): the checkpointer, then the run directory's config.yaml and metrics.jsonl (rank
// 0), last: a resume that fails to load changes nothing on disk.
void open_outputs(Run& run) {
  if (!run.cfg.train.benchmark) {
    ck::CheckpointerOptions o;
    o.keep_last = run.cfg.checkpoint.keep_last;
    o.async = run.cfg.checkpoint.async;
    o.timeout_s = run.cfg.parallel.checkpoint_timeout_s;
    o.config_hash = core::stable_hash(run.config_text);
    o.config_text = run.config_text;
    o.layout = run.plan.layout;
    run.checkpointer = std::make_unique<ck::Checkpointer>((run.dir / "checkpoints").string(), o);
  }
  if (!run.rank0) {
    run.metrics = std::make_unique<MetricsWriter>();
  } else {
    // The directory exists: RunDirectory::open created and locked it.
    const std::string archived =
        ck::record_config(run.dir.string(), run.config_text, run.start_step);
    if (!archived.empty())
      core::log::info("config.yaml: the previous config is kept as {}", archived);
    // Rows of steps after start_step were logged by a run killed after its last checkpoint: this
    // run logs them again (metrics.h).
    const std::string path = (run.dir / "metrics.jsonl").string();
    const MetricsTrim trim = trim_metrics(path, run.start_step);
    if (trim.dropped + trim.broken > 0) {
      core::log::warn(
          "{}: kept {} row(s) up to step {}, dropped {} later or summary row(s) and {} torn "
          "line(s)",
          path, trim.kept, run.start_step, trim.dropped, trim.broken);
    }
    run.metrics = std::make_unique<MetricsWriter>(path);
    if (!run.load_report.empty()) run.metrics->write_json("load", run.start_step, run.load_report);
  }
  // Start-up is over: from here on the run directory stays, whatever happens.
  run.run_directory->keep();
}

void assemble_training(Run& run) {
  open_training_world(run);
  open_data(run);
  if (run.cfg.train.cuda_graph) {
    check_graph_capturable(run);
    // From here on the training thread runs on the graph's side stream, before anything autograd
    // will use is built: a parameter's gradient accumulator (made by DDP's constructor or the
    // first backward) runs on the stream current when it was made, and the legacy default stream
    // cannot take part in a capture (PyTorch asks the same: DDP built in a side-stream context).
    run.graph =
        std::make_unique<CudaStepGraph>(run.device, run.world->rank(), run.cfg.parallel.timeout_s);
  }
  // The host memory the model and its engine take while they are set up.
  const double resident_before = proc_status_mib("VmRSS");
  const bool peak_reset = resident_before >= 0 && reset_peak_resident();
  const std::shared_ptr<units::DeferredInit> recipes = build_training_model(run);
  // optim.param_groups: checked against the whole model and its frozen rules applied before the
  // engine (and, under a pipeline, the split) sees the parameters.
  apply_param_groups(run, /*log=*/true);
  const double model_mib =
      static_cast<double>(run.model->parameter_count()) * 4 / (1024.0 * 1024.0);
  build_engine(run, recipes);
  if (peak_reset) {
    // With parallel.meta_init it stays near what this rank owns (its ZeRO-3 shard or its
    // pipeline stages); a full build holds the whole model first.
    core::log::info(
        "model setup: host peak {:.1f} MiB above the {:.1f} MiB resident before it (the model's "
        "parameters: {:.1f} MiB)",
        proc_status_mib("VmHWM") - resident_before, resident_before, model_mib);
  }
  if (run.resume) {
    compare_param_groups(run);
    load_resumed_state(run);
  }
  // A resumed delayed-scaling history decides the scales from the first step on.
  run.precision.fp8_histories_loaded();
  open_outputs(run);
}

}  // namespace
}  // namespace detail

int intra_op_threads(int configured, int local_ranks) {
  if (configured > 0) return configured;
  // OMP_NUM_THREADS as PyTorch reads it (torchrun sets it to 1 for several ranks per node): its
  // first entry, a positive integer; anything else is named once and ignored.
  if (const char* env = std::getenv("OMP_NUM_THREADS"); env != nullptr && *env != '\0') {
    const std::string value(env);
    const std::string first = value.substr(0, value.find(','));
    int n = 0;
    const auto [end, ec] = std::from_chars(first.data(), first.data() + first.size(), n);
    if (ec == std::errc() && end == first.data() + first.size() && n > 0) return n;
    static const bool warned = [&] {
      core::log::warn(
          "OMP_NUM_THREADS='{}' is not a positive integer; ignored (train.threads=0: "
          "cores / ranks on the node)",
          core::clip(value));
      return true;
    }();
    (void)warned;
  }
  // The cores this process may run on (taskset, cgroup cpusets, mpirun --bind-to), shared with the
  // other ranks of the node.
  int cores = static_cast<int>(std::thread::hardware_concurrency());
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
    cores = cores > 0 ? std::min(cores, CPU_COUNT(&set)) : CPU_COUNT(&set);
  }
  const int node_share =
      static_cast<int>(std::thread::hardware_concurrency()) / std::max(1, local_ranks);
  return std::max(1, std::min(cores, std::max(1, node_share)));
}

std::unique_ptr<Run> build_run(const RunConfig& cfg, Purpose purpose, RunOptions options) {
  auto run = std::make_unique<Run>(cfg, purpose);
  run->extension = active_extension(cfg);
  if (purpose == Purpose::kTrain) {
    run->hooks = options.hooks    ? std::move(*options.hooks)
                 : run->extension ? run->extension->hooks(cfg)
                                  : TrainerHooks{};
  }
  // Step 1, its first half: the device (plan and export: the CPU).
  const bool has_world = purpose == Purpose::kTrain || purpose == Purpose::kEval;
  if (has_world) detail::open_device(*run);
  // Step 2: one precision policy for that device; FP8 refused where it cannot run, before the
  // communicators or anything else exist.
  run->precision = optim::PrecisionPolicy::from(cfg.precision, run->device.type());
  if (has_world) {
    detail::require_fp8_device(run->precision, run->device);
    detail::open_world(*run);
  }
  switch (purpose) {
    case Purpose::kTrain:
      detail::assemble_training(*run);
      break;
    case Purpose::kEval:
    case Purpose::kExport:
      detail::open_data(*run);
      detail::restore_model(*run, options.weights);
      break;
    case Purpose::kPlan:
      detail::open_data(*run);
      detail::build_shape_model(*run, options.plan_tp, options.plan_sequence_parallel);
      break;
  }
  return run;
}

}  // namespace parallax::train
