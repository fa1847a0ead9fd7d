// The training loop (train/loop.h).
#include "train/loop.h"

#include "comm/topology.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "models/model.h"
#include "optim/schedule.h"
#include "parallel/engine.h"
#include "train/batch_source.h"
#include "train/cadence.h"
#include "train/metrics.h"
#include "train/preemption.h"
#include "train/step.h"
#include "train/step_metrics.h"

#include <fmt/format.h>

#include <cmath>

namespace parallax::train::detail {

int64_t Loop::total_steps() const {
  const TrainConfig& t = run_.cfg.train;
  if (t.epochs <= 0) return t.steps;
  PARALLAX_CHECK(
      run_.source->batches_per_epoch() > 0, ConfigError,
      "key 'train.epochs' needs a dataset (synthetic batches have no epochs); use train.steps");
  return t.epochs * run_.source->batches_per_epoch() / t.grad_accum;
}

bool Loop::prepare() {
  std::map<std::string, double> m;
  {
    // Parameters whole for the call (ZeRO-3), as for evaluation.
    parallel::FullParams whole(*run_.engine);
    const TrainingStart start{*run_.model,
                              run_.resumed,
                              run_.topo->dp(),
                              run_.device,
                              [this] { return core::to_device(run_.source->next(), run_.device); },
                              [this](const core::TensorDict& batch) {
                                optim::AutocastGuard autocast(run_.precision);
                                return run_.model->forward(batch);
                              },
                              [this] { return evaluate_run(run_); },
                              run_.rank0 ? run_.dir.string() : std::string()};
    try {
      m = run_.hooks.prepare(start);
    } catch (const PreemptedError& e) {
      core::log::warn("{}", e.what());
      return false;
    }
    // What prepare wrote into the parameters (e.g. learned quantiser scales) is
    // kept: ZeRO-3 copies it into the shards before the gathered parameters are released.
    run_.engine->commit_full_params();
  }
  // A resume's buffers (and the prepared ones) are the same on every rank; DDP's buffer broadcast
  // (parallel.ddp.broadcast_buffers) keeps them so.
  if (!m.empty()) run_.metrics->write("prepare", run_.start_step, m);
  return true;
}

TrainSummary Loop::without_steps() {
  const int64_t step = run_.start_step;
  core::log::info("train.steps ignored: this trainer takes no optimizer step (step {})", step);
  Cadence cadence(run_, step, /*loop=*/false);
  cadence.evaluate(step);
  cadence.save(step);
  cadence.wait_for_saves();
  // A preempted evaluation: the prepared model is saved; only its eval row is missing.
  if (cadence.preempted_during_eval()) {
    mark_preempted();
  } else {
    cadence.finish(step, NAN, 0.0, /*wall_s=*/-1);
  }
  return TrainSummary{run_.dir.string(), step, NAN, 0};
}

TrainSummary Loop::fit() {
  if (run_.hooks.prepare && !prepare()) {
    // Preempted while preparing (e.g. a calibration): no step ran and nothing changed that a
    // checkpoint would hold; the same command starts over.
    mark_preempted();
    return TrainSummary{run_.dir.string(), run_.start_step, NAN, 0};
  }
  if (!run_.hooks.trains) return without_steps();

  const int64_t total = total_steps();
  StepRunner steps(run_);
  StepMetrics metrics(run_, steps, total);
  core::log::info(
      "training {} steps: global batch {} ({} per rank x {} micro-steps x dp {}), precision {}",
      total, metrics.global_batch(), run_.cfg.data.batch_size, run_.cfg.train.grad_accum,
      run_.plan.layout.dp, run_.cfg.precision.mode);
  if (run_.start_step >= total) {
    core::log::info("checkpoint step {} >= train.steps {}: nothing to train", run_.start_step,
                    total);
  }
  Cadence cadence(run_, total);
  core::Stopwatch run_clock;
  double first_step_s = 0;
  for (int64_t step = run_.start_step + 1; step <= total; ++step) {
    if (cadence.stop_before(step)) break;
    const double lr = optim::lr_at(run_.cfg.schedule, run_.cfg.optim.lr, step, total);
    cadence.before_step(step);
    auto terms = steps.run(step, lr, metrics.logs(step));
    cadence.after_step(step);
    if (step == run_.start_step + 1) first_step_s = run_clock.elapsed_s();
    metrics.after_step(step, lr, terms);
    if (cadence.evaluate_if_due(step)) metrics.restart_interval();  // eval is not training time
    cadence.save_if_due(step);  // its blocking time counts in the next interval
  }
  cadence.loop_done();
  TrainSummary summary{run_.dir.string(), metrics.last_logged(), metrics.last_loss(), 0};
  if (cadence.stopped_after() >= 0) {
    steps.drain();
    cadence.wait_for_saves();
    mark_preempted();
    core::log::warn(
        "preempted: stopped after step {} of {}{}", cadence.stopped_after(), total,
        run_.checkpointer ? "; resume with train.resume=auto" : " (checkpointing is off)");
    return summary;
  }
  if (total > run_.start_step) {
    cadence.evaluate(total);
    cadence.save(total);
    if (cadence.preempted_during_eval()) {
      // The last step is saved; only the final evaluation's row is missing.
      steps.drain();
      cadence.wait_for_saves();
      mark_preempted();
      core::log::warn("preempted during the final evaluation: step {} is saved", total);
      return summary;
    }
  }
  steps.drain();
  cadence.wait_for_saves();
  const double run_s = run_clock.elapsed_s();
  const int64_t ran = total - run_.start_step;
  if (ran > 1) {
    summary.samples_per_s =
        (ran - 1) * metrics.global_batch() / std::max(1e-9, run_s - first_step_s);
  }
  if (run_.start_step < total) {
    metrics.progress().finish(fmt::format("final loss {:.4f}, {:.1f} samples/s", summary.final_loss,
                                          summary.samples_per_s));
  }
  cadence.finish(summary.steps, summary.final_loss, summary.samples_per_s, run_s);
  return summary;
}

}  // namespace parallax::train::detail
