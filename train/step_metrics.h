// Internal to the trainer (train/trainer.h is the API): the step metrics of a run's loop, one
// component: at log steps the data-parallel mean of the loss terms and the row of metrics.jsonl
// (lr, grad norm, loss scale, step, data, exposed-communication and backward times, throughput,
// peak memory and MFU) with the progress line; at other steps the finite-loss check where it is
// free (the CPU). A non-finite loss is a NumericsError naming the step.
//
// Thread-safety: the training thread only. Collective at log steps (a small all-reduce over dp).
#pragma once

#include "core/progress.h"
#include "core/timer.h"
#include "train/run.h"
#include "train/step.h"

#include <map>
#include <string>

namespace parallax::train::detail {

class StepMetrics {
 public:
  // `total`: the run's last step (the progress line's end).
  StepMetrics(Run& run, StepRunner& steps, int64_t total);

  int64_t global_batch() const { return global_batch_; }
  // Whether step `step` writes a row (train.log_every, and the last step).
  bool logs(int64_t step) const { return step % run_.cfg.train.log_every == 0 || step == total_; }
  // After step `step` ran at learning rate `lr` with loss terms `terms` of this rank: its row at a
  // log step (returns the data-parallel mean loss), else the CPU's finite-loss check (returns NaN).
  double after_step(int64_t step, double lr, std::map<std::string, at::Tensor>& terms);
  // Time from here on is training time again (evaluation and the first step's set-up are not).
  void restart_interval();
  // The summary's figures: the last logged loss, and the throughput after the first step.
  double last_loss() const { return last_loss_; }
  int64_t last_logged() const { return last_logged_; }
  core::Progress& progress() { return progress_; }

 private:
  double log_row(int64_t step, double lr, std::map<std::string, at::Tensor>& terms);

  Run& run_;
  StepRunner& steps_;
  const int64_t total_;
  int64_t global_batch_ = 0;
  double flops_per_step_ = 0;
  core::Progress progress_;
  core::Stopwatch interval_clock_;
  int64_t interval_steps_ = 0;
  double last_loss_;
  int64_t last_logged_;
};

}  // namespace parallax::train::detail
