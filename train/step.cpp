// One optimizer step of a run (train/step.h).
#include "train/step.h"

#include "comm/world.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "models/model.h"
#include "optim/grad_utils.h"
#include "optim/optimizer.h"
#include "parallel/engine.h"
#include "train/batch_source.h"
#include "train/cuda_graph.h"
#include "train/metrics.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>

namespace parallax::train::detail {

namespace {

// Loss normalisers over the whole data-parallel batch during the step only: evaluation runs a
// different number of batches per rank and must not issue collectives.
class ReplicaMeanScope {
 public:
  ReplicaMeanScope(models::Model& m, const models::ReplicaMean& mean) : model_(m) {
    model_.set_replica_mean(mean);
  }
  ~ReplicaMeanScope() { model_.set_replica_mean({}); }
  ReplicaMeanScope(const ReplicaMeanScope&) = delete;
  ReplicaMeanScope& operator=(const ReplicaMeanScope&) = delete;

 private:
  models::Model& model_;
};

// The step's functions as the engine takes them (parallel/engine.h StepFns): the model whole
// (forward_loss) and as its chain of units (begin / run / finish, for a pipeline's stages).
class StepFunctions {
 public:
  StepFunctions(Run& run, const std::function<core::TensorDict(int)>& batch_of)
      : run_(run), batch_of_(batch_of), accum_(run.cfg.train.grad_accum) {}

  parallel::StepFns fns() {
    parallel::StepFns f;
    f.forward_loss = [this](int micro) { return forward_loss(micro); };
    f.begin = [this](int micro) {
      optim::AutocastGuard autocast(run_.precision);
      return run_.model->chain_begin(chain_batch(micro, true));
    };
    f.run = [this](int micro, int first, int last, const std::vector<at::Tensor>& in) {
      optim::AutocastGuard autocast(run_.precision);
      return run_.model->run_chain(first, last, chain_batch(micro, first == 0), in);
    };
    f.finish = [this](int micro, const std::vector<at::Tensor>& out) {
      const core::TensorDict& batch = chain_batch(micro, false);
      models::LossOutput loss;
      {
        optim::AutocastGuard autocast(run_.precision);
        loss = run_.model->loss(batch, run_.model->chain_end(batch, out));
        if (run_.hooks.task_loss_weight != 1.0)
          loss.total = loss.total * run_.hooks.task_loss_weight;
      }
      return micro_loss(loss);
    };
    return f;
  }

 private:
  // One micro-batch's loss as the engine takes it: what the backward starts from, and the terms
  // to log, each divided by the micro-batch count so that the engine's sum over them is the mean.
  parallel::MicroLoss micro_loss(const models::LossOutput& loss) const {
    parallel::MicroLoss m;
    m.terms["loss"] = loss.total.detach() / accum_;
    for (const auto& [k, v] : loss.terms) m.terms["loss_" + k] = v.detach().to(at::kFloat) / accum_;
    m.backprop = run_.precision.scale_loss(loss.total / static_cast<double>(accum_));
    return m;
  }

  parallel::MicroLoss forward_loss(int micro) {
    const core::TensorDict batch = batch_of_(micro);
    models::LossOutput loss;
    {
      optim::AutocastGuard autocast(run_.precision);
      const auto pred = run_.model->forward(batch);
      loss = run_.model->loss(batch, pred);
      if (run_.hooks.task_loss_weight != 1.0) loss.total = loss.total * run_.hooks.task_loss_weight;
      if (run_.hooks.extra_loss) {
        // Extra terms (distillation against the frozen model, regularisers): added to the total,
        // logged as loss_<name>.
        for (auto& [name, term] : run_.hooks.extra_loss(batch, pred, run_.frozen.get())) {
          loss.total = loss.total + term;
          loss.terms[name] = term.detach();
        }
      }
    }
    return micro_loss(loss);
  }

  // Each unit range reads its side inputs from the micro-batch: every rank of a pipeline draws the
  // same batches (the data stream follows the dp coordinate); ranges after the first do not see
  // the images. The step's batches are drawn together, in order, at the first use.
  const core::TensorDict& chain_batch(int micro, bool whole) {
    if (whole_.empty()) {
      for (int i = 0; i < accum_; ++i) whole_.push_back(batch_of_(i));
      side_ = whole_;
      for (auto& b : side_) b.erase("images");
    }
    return (whole ? whole_ : side_).at(static_cast<std::size_t>(micro));
  }

  Run& run_;
  const std::function<core::TensorDict(int)>& batch_of_;
  const int accum_;
  std::vector<core::TensorDict> whole_, side_;
};

}  // namespace

StepRunner::StepRunner(Run& run) : run_(run), replica_mean_(run.engine->replica_mean()) {}

std::map<std::string, at::Tensor> StepRunner::run(int64_t step, double lr, bool log_step) {
  return run_.graph ? graph_step(step, lr, log_step) : eager_step(step, lr, log_step);
}

void StepRunner::drain() {
  if (run_.graph) replay_or_abort([&] { run_.graph->drain(); });
}

void StepRunner::replay_or_abort(const std::function<void()>& launch) {
  try {
    launch();
  } catch (const TimeoutError& e) {
    std::fprintf(stderr, "parallax: error: %s\n", e.what());
    run_.world->abort(1);
  }
}

std::map<std::string, at::Tensor> StepRunner::eager_step(int64_t step, double lr, bool log_step) {
  auto terms = compute_step(
      [&](int) {
        core::Stopwatch data_clock;
        core::TensorDict batch = core::to_device(run_.source->next(), run_.device);
        times_.data_ms += data_clock.elapsed_ms();
        return batch;
      },
      lr, log_step);
  // Drop the gradients (PyTorch's zero_grad default): the next backward writes each one once
  // instead of filling zeros and accumulating into them. Under DDP with flat buckets the first
  // gradients of a step are then copied into their bucket (one multi-tensor copy per bucket) and
  // become the bucket views again, as PyTorch's reducer does with gradient_as_bucket_view: half
  // the bytes of a zero fill plus an accumulate. With grouped buckets the new gradients are
  // reduced where autograd wrote them.
  // The first step of a fresh run records what every rank's engine holds with the gradients still
  // there (a resumed run's rows continue the first run's).
  if (step == 1 && run_.start_step == 0) record_engine_memory(step);
  run_.engine->zero_grad();
  return terms;
}

void StepRunner::stage_graph_inputs(int64_t step) {
  // This step's batches go into the captured input buffers (stream-ordered after the last replay
  // that read them); the first step allocates them.
  for (int micro = 0; micro < run_.cfg.train.grad_accum; ++micro) {
    core::Stopwatch data_clock;
    core::TensorDict batch = core::to_device(run_.source->next(), run_.device);
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
    times_.data_ms += data_clock.elapsed_ms();
  }
}

std::map<std::string, at::Tensor> StepRunner::graph_step(int64_t step, double lr, bool log_step) {
  stage_graph_inputs(step);
  parallel::Engine& engine = *run_.engine;
  // Buffers are broadcast once per step, before the graph (a blocking broadcast cannot be
  // captured).
  engine.broadcast_buffers();
  engine.optimizer().set_lr(lr);
  const auto inputs = [this](int micro) { return graph_inputs_[static_cast<std::size_t>(micro)]; };
  if (step - run_.start_step <= run_.cfg.train.cuda_graph_warmup) {
    // Warm-up: the same step eagerly, on the side stream and with the device learning rate.
    auto terms = compute_step(inputs, lr, log_step);
    engine.zero_grad();
    engine.optimizer().count_step();
    return terms;
  }
  if (!run_.graph->captured()) {
    // The gradients are allocated by the captured backward (from the graph's memory pool) and stay
    // the graph's: replays overwrite them, nothing sets them to None.
    engine.zero_grad();
    core::Stopwatch capture_clock;
    try {
      run_.graph->capture([&] { graph_terms_ = compute_step(inputs, lr, /*log_step=*/false); });
    } catch (const std::exception& e) {
      throw_error<Error>(
          "train.cuda_graph: capturing step {} on rank {} failed: {} (something in the step "
          "synchronises with the host or changes shape; set train.cuda_graph=false)",
          step, run_.world->rank(), e.what());
    }
    core::log::info("CUDA graph: step {} captured in {:.2f} s", step, capture_clock.elapsed_s());
  }
  replay_or_abort([&] { run_.graph->replay(step); });
  engine.optimizer().count_step();
  if (log_step && run_.cfg.optim.grad_clip <= 0) {
    // Without clipping the norm is only a metric: computed eagerly from the replay's gradients.
    grad_norm_ = optim::clip_grad_norm(engine.grads(), 0.0);
  }
  return graph_terms_;
}

std::map<std::string, at::Tensor> StepRunner::compute_step(
    const std::function<core::TensorDict(int)>& batch_of, double lr, bool log_step) {
  parallel::Engine& engine = *run_.engine;
  ReplicaMeanScope replica_mean(*run_.model, replica_mean_);
  StepFunctions functions(run_, batch_of);
  // graph_step broadcasts buffers once before the graph.
  std::map<std::string, at::Tensor> terms =
      engine.step(functions.fns(), /*sync_buffers=*/!run_.graph);
  times_.comm_ms += engine.last_exposed_comm_ms();
  times_.backward_ms += engine.last_backward_ms();

  // Each gradient group says which communicators it is sharded over: the inf check and the norm
  // count every element once (DDP: replicated; ZeRO: sharded over dp).
  const std::vector<optim::GradGroup> grads = engine.grads();
  const bool found_inf = run_.precision.unscale_and_check(grads);
  // Without clipping the norm is only a metric: computing it every step took ~1.9 ms of host time
  // per profiled ViT-B step (a multi-tensor norm over ~150 gradients and a stack), at the end of
  // the step, where the GPU waits for the host (bench/NOTES.md lever 15).
  const double clip = run_.cfg.optim.grad_clip;
  if (clip > 0 || log_step) {
    grad_norm_ = optim::clip_grad_norm(grads, found_inf ? 0.0 : clip);
  } else {
    grad_norm_ = at::Tensor();
  }
  if (!found_inf) engine.update(lr);
  run_.precision.after_step(found_inf);
  return terms;
}

void StepRunner::record_engine_memory(int64_t step) {
  const parallel::EngineMemory m = run_.engine->memory();
  const comm::CommPtr& world = run_.world_comm;
  const c10::Device dev = world->device_type() == c10::kCPU ? c10::Device(c10::kCPU) : run_.device;
  at::Tensor mine =
      at::tensor(std::vector<int64_t>{m.params, m.grads, m.optimizer}, at::kLong).to(dev);
  at::Tensor all = at::empty({3 * world->size()}, mine.options());
  world->all_gather_async(mine, all)->wait();
  const at::Tensor host = all.cpu();
  std::map<std::string, double> row;
  for (int r = 0; r < world->size(); ++r) {
    row[fmt::format("params_r{}", r)] = static_cast<double>(host[3 * r].item<int64_t>());
    row[fmt::format("grads_r{}", r)] = static_cast<double>(host[3 * r + 1].item<int64_t>());
    row[fmt::format("optimizer_r{}", r)] = static_cast<double>(host[3 * r + 2].item<int64_t>());
  }
  run_.metrics->write("memory", step, row);
}

}  // namespace parallax::train::detail
