// The trainer's loop (train/trainer_impl.h has the class; setup and checkpoints are in
// trainer_setup.cpp and trainer_state.cpp).
#include "train/trainer_impl.h"

namespace parallax::train::detail {

namespace {

// "NaN", "inf" or "-inf" (the platform prints "-nan" for some NaNs).
std::string nonfinite_name(double v) {
  return std::isnan(v) ? "NaN" : (v > 0 ? "inf" : "-inf");
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
  const fs::path tool = fs::path(core::source_dir()) / "tools" / "plot_metrics.py";
  std::error_code ec;
  if (!fs::exists(tool, ec)) {
    core::log::warn("plots skipped: '{}' not found", tool.string());
    return;
  }
  const std::string cmd =
      fmt::format("'{}' '{}' '{}' 2>&1", core::python_exe(), tool.string(), run_dir.string());
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

}  // namespace

void TrainerImpl::replay_or_abort(const std::function<void()>& launch) {
  try {
    launch();
  } catch (const TimeoutError& e) {
    std::fprintf(stderr, "parallax: error: %s\n", e.what());
    world_.abort(1);
  }
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
  // The delayed recipe's amaxes of this step into the histories (kernels/fp8.h).
  if (!fp8_layers_.empty()) kernels::fp8::roll_histories(fp8_layers_, fp8_reduce_);
  return terms;
}

// After the first step (gradients exist): what every rank's engine holds, as one metrics row of
// kind "memory" (params_r<i>, grads_r<i>, optimizer_r<i>, bytes), which `parallax plan` predicts
// exactly (tests/train/test_planner.py). Collective over the world.
void TrainerImpl::record_engine_memory(int64_t step) {
  const parallel::EngineMemory m = engine_->memory();
  const c10::Device dev =
      world_comm_->device_type() == c10::kCPU ? c10::Device(c10::kCPU) : device_;
  at::Tensor mine =
      at::tensor(std::vector<int64_t>{m.params, m.grads, m.optimizer}, at::kLong).to(dev);
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
                                if (synthetic_ || no_eval_split_ || cfg_.model.name != "bev")
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
    // What prepare wrote into the parameters (QAT's learned scales: their calibrated amax) is
    // kept: ZeRO-3 copies it into the shards before the gathered parameters are released.
    engine_->commit_full_params();
  }
  // A resume's buffers (and the prepared ones) are the same on every rank; DDP's buffer broadcast
  // (parallel.ddp.broadcast_buffers) keeps them so.
  if (!m.empty()) metrics_->write("prepare", start_step_, m);
  return true;
}

void TrainerImpl::run_eval(int64_t step) {
  if (synthetic_ || no_eval_split_ || cfg_.model.name != "bev") return;
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

  // Rates and the ETA count the steps of this process only (a resumed run did the others).
  core::Progress progress("step", total, 5.0, start_step_);
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
            "loss is {} at step {} on rank {} (metrics so far are in {}); {}", nonfinite_name(v),
            step, world_.rank(), (run_dir_ / "metrics.jsonl").string(),
            nonfinite_loss_hint(step, "lower optim.lr or check the data"));
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
          "loss is {} at step {} (data-parallel mean; last finite log is in {}); {}",
          nonfinite_name(loss), step, (run_dir_ / "metrics.jsonl").string(),
          nonfinite_loss_hint(step, "lower optim.lr or use precision.mode=bf16"));
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
                                       (peak_flops_per_gpu(precision_.mode) * world_.size())
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
  if (start_step_ < total) {
    progress.finish(fmt::format("final loss {:.4f}, {:.1f} samples/s", summary.final_loss,
                                summary.samples_per_s));
  }
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

}  // namespace parallax::train::detail

namespace parallax::train {

struct Trainer::Impl {
  Impl(RunConfig& cfg, TrainerHooks hooks) : trainer(cfg, std::move(hooks)) {}
  detail::TrainerImpl trainer;
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
