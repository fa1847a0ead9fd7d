// The trainer's setup: device, world, run directory, resume, data, model, plan and engine
// (train/trainer_impl.h has the class).
#include "train/trainer_impl.h"

#include "data/schema.h"
#include "parallel/comm/startup.h"

#include <sched.h>

#include <charconv>
#include <cstdlib>
#include <fstream>

namespace parallax::train::detail {

namespace {

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

}  // namespace

void TrainerImpl::enable_fp8() {
  const int n = train::apply_fp8(*model_, cfg_);
  const kernels::fp8::Recipe recipe =
      kernels::fp8::parse_recipe(cfg_.precision.fp8.recipe, "precision.fp8.recipe");
  fp8_layers_ = kernels::fp8::fp8_layers(*model_);
  for (auto* l : fp8_layers_) l->to(device_);
  std::vector<comm::CommPtr> groups;
  for (const char* g : {"dp", "tp"}) {
    const comm::CommPtr& c = topo_->group(g);
    if (c && c->size() > 1) groups.push_back(c);
  }
  if (!groups.empty()) {
    fp8_reduce_ = [groups](at::Tensor& amax) {
      for (const auto& c : groups) c->all_reduce_async(amax, comm::ReduceOp::kMax)->wait_stream();
    };
  }
  core::log::info(
      "precision fp8: {} linear layers (the ViT blocks' qkv, proj, fc1, fc2) on FP8 tensor cores, "
      "E4M3 forward and E5M2 gradients, {} scaling{}",
      n, recipe == kernels::fp8::Recipe::kDelayed ? "delayed" : "current",
      recipe == kernels::fp8::Recipe::kDelayed
          ? fmt::format(" over {} steps of amax history", cfg_.precision.fp8.amax_history)
          : "");
}

void TrainerImpl::setup() {
  device_ = pick_device(cfg_.train, world_);
  precision_ = optim::make_precision_policy(cfg_.precision, device_.type());
  if (precision_.fp8()) train::require_fp8_device(device_);  // before anything is built
  // Ranks sharing a node share its cores: without this, every rank would start one intra-op
  // thread per core and they would all fight over them (intra_op_threads).
  const int threads = intra_op_threads(cfg_.train.threads, world_.launch().local_world_size);
  at::set_num_threads(threads);
  const auto& p = cfg_.parallel;
  comm::CommOptions opts =
      comm::make_comm_options(p.timeout_s, comm::startup_deadline_s(p.init_timeout_s, p.timeout_s),
                              p.checkpoint_timeout_s, p.debug_collectives, p.flight_recorder_size,
                              p.allreduce, static_cast<int64_t>(p.ring_chunk_mb * (1 << 20)));
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
                               world_.size(), gpus, plan_transforms(cfg_));
  const comm::Layout layout = plan_.layout;
  // First collective on world_comm_: rank 0 checks, creates and locks the run directory for the
  // whole run, and every rank learns the outcome (a second job on it fails here on every rank).
  run_directory_.emplace(
      RunDirectory::open(cfg_.experiment, cfg_.train.resume.empty(), *world_comm_, device_));
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
  const std::optional<ck::ResumePoint> chosen = choose_resume_point(ckpt_dir.string());
  const std::vector<int64_t> steps = comm::agree_on(
      *world_comm_, device_, "resume: choosing and opening the checkpoint", [&]() -> int64_t {
        const std::optional<ck::ResumePoint>& point = chosen;
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
    // Evaluation reads data.val_split: a dataset without it is found now, not after training.
    if (cfg_.model.name == "bev") {
      const data::DatasetInfo info = data::read_dataset_info(cfg_.data.path);
      if (!info.splits.count(cfg_.data.val_split)) {
        std::vector<std::string> names;
        for (const auto& [name, _] : info.splits) names.push_back(name);
        PARALLAX_CHECK(cfg_.train.eval_every == 0, ConfigError,
                       "key 'data.val_split': dataset '{}' has no split '{}' (its splits: {}); "
                       "name one of them, or set train.eval_every=0 to train without evaluation",
                       cfg_.data.path, cfg_.data.val_split, core::join(names, ", "));
        core::log::warn(
            "dataset '{}' has no split '{}' (data.val_split; its splits: {}): no evaluation at the "
            "end of training",
            cfg_.data.path, cfg_.data.val_split, core::join(names, ", "));
        no_eval_split_ = true;
      }
    }
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
  // The model, its tensor-parallel layers built by the factory over the plan's group (plan step 1,
  // parallel/parallelize.h).
  tp_ = parallel::tensor_parallel_group(plan_, *topo_);
  // ZeRO-3 over several ranks, or pipeline stages, build the model without storage; each rank then
  // materialises only what it owns, its ZeRO-3 shard or its stages (parallel.meta_init;
  // core/param_init.h, parallel/parallelize.h): with the values a full build gives, or read one
  // tensor at a time from train.load_from's weights, or (a resumed pipeline run) from the
  // checkpoint. A model transform that cannot work on recipes (QAT's weight ranges) needs the
  // full build; LoRA's adapters become recipes too (TrainerHooks::transform_defers).
  std::shared_ptr<core::DeferredInit> recipes;
  const bool sharded_model = plan_.shards_model();
  const bool defer = cfg_.parallel.meta_init && (sharded_model || plan_.layout.pp > 1) &&
                     (!hooks_.transform_model || hooks_.transform_defers);
  // Pretrained weights (not when resuming: the checkpoint holds the trained model) and the
  // resumed model go into the model as built (deferred: into its recipes).
  const bool load_pretrained =
      (!resume_ || hooks_.saves_model_tensor) && !cfg_.train.load_from.empty();
  const std::string deferred_source = !defer                      ? std::string()
                                      : load_pretrained           ? cfg_.train.load_from
                                      : resume_ && !sharded_model ? resume_->dir()
                                                                  : std::string();
  // Each rank reads only its slices of tensor-parallel tensors (HDF5 hyperslabs of a weights file
  // or a checkpoint's boxes; the others whole): no rank holds the whole model.
  ck::WeightsOptions w;
  w.strict = cfg_.train.strict_load;
  const auto read_tp_slices = [&] {
    if (!tp_) return;
    auto layouts = std::make_shared<const std::map<std::string, tensor::ParamLayout>>(
        tensor::param_layouts(*model_));
    w.boxes_of = [layouts](const std::string& name,
                           const at::Tensor& local) -> std::optional<ck::TensorBoxes> {
      const auto it = layouts->find(name);
      if (it == layouts->end()) return std::nullopt;
      ck::TensorBoxes b;
      b.shape = tensor::global_shape(local.sizes().vec(), it->second);
      for (auto& box : tensor::split_boxes(local, it->second))
        b.boxes.emplace_back(box.local, std::move(box.offsets));
      return b;
    };
  };
  // A NaN in the loaded weights would only show as a NaN loss at step 1 ("lower optim.lr"):
  // named at load time. LoRA checks its base itself (naming it as the LoRA base).
  const std::string load_context = fmt::format("train.load_from '{}'", cfg_.train.load_from);
  const char* load_advice = "point train.load_from at an earlier checkpoint";
  // The host memory the model and its engine take while they are set up (below).
  const double resident_before = proc_status_mib("VmRSS");
  const bool peak_reset = resident_before >= 0 && reset_peak_resident();
  double load_s = 0;  // checkpoint read time: the weights here, the optimizer state below
  if (defer) {
    {
      core::DeferredInitScope deferred;
      model_ = tp_ ? models::build_model(cfg_.model, scene_, tp_)
                   : models::build_model(cfg_.model, scene_);
      recipes = deferred.recipes();
    }
    if (!deferred_source.empty()) {
      read_tp_slices();
      // Checked (names and shapes) on every rank before any engine exists: a rank that fails
      // alone must not leave the others in the engine's first collective.
      comm::agree_on(*world_comm_, device_,
                     load_pretrained
                         ? load_context
                         : fmt::format("resume from '{}': loading the model", deferred_source),
                     [&]() -> int64_t {
                       ck::DeferredWeights dw = ck::defer_weights(*model_, deferred_source, w);
                       if (load_pretrained) {
                         core::log::info("train.load_from={}: {} (each rank reads what it owns)",
                                         deferred_source, dw.report.summary());
                       }
                       // Pretrained weights are checked for NaN as each tensor is read (the
                       // checkpoint of a resume: after the engine, check_resumed_state_finite).
                       for (auto& [name, read] : dw.readers) {
                         if (!load_pretrained) {
                           recipes->replace(name, read);
                           continue;
                         }
                         recipes->replace(name, [read, name = name, load_context, load_advice]() {
                           at::Tensor v = read();
                           ck::require_finite({{name, v}}, load_context, load_advice);
                           return v;
                         });
                       }
                       return 0;
                     });
    }
    if (resume_ && sharded_model && deferred_source.empty()) {
      // A resumed ZeRO-3 run reads each rank's shard from the checkpoint after the engine has
      // sharded the model (below), overwriting every parameter the checkpoint holds: those start
      // as zeros rather than as their initialisation's draws, which cost as much as the model's
      // size in random numbers on every rank for nothing. Buffers keep their values: they are
      // small, and setup reads some before the resume (mlp's teacher makes the synthetic data).
      const auto& saved = resume_->metadata().tensors;
      std::size_t skipped = 0;
      const auto skip = [&](const std::string& name, const at::Tensor& t) {
        if (!saved.count(ck::kModelPrefix + name)) return;
        recipes->replace(name, [shape = t.sizes().vec()] { return at::zeros(shape); });
        ++skipped;
      };
      for (const auto& item : model_->named_parameters()) skip(item.key(), item.value());
      core::log::info(
          "resume: {} of {} model tensors skip their initialisation (the checkpoint "
          "overwrites them)",
          skipped, recipes->size());
    }
    if (hooks_.transform_model) {
      // The transform on the recipes (its tensors recorded as recipes and named like the model's).
      {
        core::DeferredInitScope more(recipes);
        hooks_.transform_model(*model_);
      }
      recipes->bind(*model_);
    }
    core::place_deferred(*model_, *recipes, device_);
    core::log::info(
        "model built without storage (parallel.meta_init): {} tensors, each rank "
        "materialises its {}{}",
        recipes->size(), sharded_model ? "ZeRO-3 shard" : "pipeline stages",
        deferred_source.empty() ? "" : fmt::format(" from '{}'", deferred_source));
  } else {
    model_ = tp_ ? models::build_model(cfg_.model, scene_, tp_)
                 : models::build_model(cfg_.model, scene_);
    model_->to(device_);
  }
  model_->train();
  // Pretrained weights go into the model as built; the transform (e.g. LoRA adapters, QAT
  // observers) comes after them, and a resumed checkpoint, saved from the transformed model, is
  // loaded after the transform. A checkpoint that holds only some model tensors
  // (TrainerHooks::saves_model_tensor, e.g. LoRA's adapters) needs these weights on resume too.
  if (load_pretrained && !defer) {
    read_tp_slices();
    // A rank that fails alone (a NaN only in its slice) must not leave the others waiting in the
    // engine's first collective.
    comm::agree_on(*world_comm_, device_, load_context, [&]() -> int64_t {
      const auto report = ck::load_weights(*model_, cfg_.train.load_from, w);
      core::log::info("train.load_from={}: {}", cfg_.train.load_from, report.summary());
      if (cfg_.lora.rank == 0) ck::require_finite(*model_, load_context, load_advice);
      return 0;
    });
  }
  if (hooks_.transform_model && !defer) {
    hooks_.transform_model(*model_);
    model_->to(device_);  // parameters the transform added
  }
  // After the pretrained weights (which hold no scaling state), before the resume (which does).
  if (precision_.fp8()) enable_fp8();
  // A deferred pipeline model read the checkpoint into its recipes (above), before the FP8 layers
  // and their histories existed: they are read here, so that the resume stays bitwise.
  if (resume_ && defer && deferred_source == resume_->dir() && !fp8_layers_.empty()) {
    comm::agree_on(*world_comm_, device_,
                   fmt::format("resume from '{}': loading the FP8 amax histories", resume_->dir()),
                   [&]() -> int64_t {
                     load_fp8_histories();
                     return 0;
                   });
  }
  // ZeRO-3 over several ranks reads each rank's shard of the model after the engine has sharded
  // it (below), so no rank reads the whole model from the checkpoint; a deferred pipeline model
  // reads it into its recipes (above).
  if (resume_ && !sharded_model && deferred_source != resume_->dir()) {
    core::Stopwatch load_clock;
    // Each rank reads its part (tensor or pipeline parallelism: its slices); a rank that fails
    // alone must not leave the others in the engine's first collective (agree_on).
    comm::agree_on(*world_comm_, device_,
                   fmt::format("resume from '{}': loading the model", resume_->dir()),
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

  // The plan applied to the model: tensor parallelism, activation checkpointing, pipeline stages,
  // then DDP or ZeRO over the data-parallel group, with the optimizer (parallel/parallelize.h).
  parallel::ParallelizeOptions po;
  po.model_name = cfg_.model.name;
  po.micro_batches = cfg_.train.grad_accum;
  po.optimizer = cfg_.optim;
  po.compute_bytes = precision_.compute_bytes();
  po.cuda = device_.is_cuda();
  po.deferred = recipes;
  const double model_mib = static_cast<double>(model_->parameter_count()) * 4 / (1024.0 * 1024.0);
  engine_ = parallel::parallelize(*model_, plan_, *topo_, tp_, po);
  if (peak_reset) {
    // With parallel.meta_init it stays near what this rank owns (its ZeRO-3 shard or its
    // pipeline stages); a full build holds the whole model first.
    core::log::info(
        "model setup: host peak {:.1f} MiB above the {:.1f} MiB resident before it (the model's "
        "parameters: {:.1f} MiB)",
        proc_status_mib("VmHWM") - resident_before, resident_before, model_mib);
  }
  // Loss normalisers over the replicas (Model::set_replica_mean), installed around each step.
  replica_mean_ = engine_->replica_mean();

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
  // A resumed delayed-scaling history decides the scales from the first step on.
  for (auto* l : fp8_layers_) l->history_loaded();
  // Last, once the run is known to start: a resume that fails to load changes nothing on disk.
  open_run_directory(config_text);
  // Start-up is over: from here on the run directory stays, whatever happens.
  if (run_directory_) run_directory_->keep();
}

void TrainerImpl::load_fp8_histories() {
  const auto& saved = resume_->metadata().tensors;
  int loaded = 0;
  for (const auto& item : model_->named_modules()) {
    auto* layer = dynamic_cast<kernels::fp8::Fp8LinearImpl*>(item.value().get());
    if (layer == nullptr || !layer->amax_history.defined()) continue;
    // The layer's own tensor "amax_history" under the model path "<layer>.fp8.": a checkpoint
    // saved under the current recipe has none, and the history starts empty (docs/training.md).
    ck::WeightsOptions o;
    o.prefix = std::string(ck::kModelPrefix) + item.key() + ".";
    if (!saved.count(o.prefix + "amax_history")) continue;
    ck::load_weights(*resume_, *layer, o);
    ++loaded;
  }
  core::log::info("resume: {} FP8 amax histories read from '{}'", loaded, resume_->dir());
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
    core::log::warn(
        "{}: kept {} row(s) up to step {}, dropped {} later or summary row(s) and {} torn line(s)",
        metrics_path, trim.kept, start_step_, trim.dropped, trim.broken);
  }
  metrics_ = std::make_unique<MetricsWriter>(metrics_path);
}

void TrainerImpl::check_graph_capturable() const {
  const auto& p = cfg_.parallel;
  PARALLAX_CHECK(
      device_.is_cuda(), ConfigError,
      "key 'train.cuda_graph': CUDA graphs need a GPU, but rank {} trains on {} (train.device={})",
      world_.rank(), device_.str(), cfg_.train.device);
  PARALLAX_CHECK(
      precision_.mode != optim::Precision::kFp16, ConfigError,
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

}  // namespace parallax::train::detail

namespace parallax::train {

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

void require_fp8_device(const c10::Device& device) {
  const std::string blocker = kernels::fp8::fp8_device_blocker(device);
  PARALLAX_CHECK(blocker.empty(), ConfigError,
                 "key 'precision.mode': fp8 needs an NVIDIA GPU with FP8 tensor cores: {}; use "
                 "precision.mode=bf16",
                 blocker);
}

int apply_fp8(torch::nn::Module& model, const RunConfig& cfg) {
  kernels::fp8::Fp8Options o;
  o.recipe = kernels::fp8::parse_recipe(cfg.precision.fp8.recipe, "precision.fp8.recipe");
  o.amax_history = cfg.precision.fp8.amax_history;
  const int n = models::enable_fp8(model, o);
  PARALLAX_CHECK(n > 0, ConfigError,
                 "key 'precision.mode': fp8 computes the ViT blocks' linear layers in FP8, and "
                 "model '{}'{} has none; use precision.mode=bf16",
                 cfg.model.name, cfg.model.name == "bev" ? " with this backbone" : "");
  return n;
}

}  // namespace parallax::train
