// Internal to the trainer (train/trainer.h is the API): what happens in a run's loop every N steps,
// one component the loop asks after each step:
//   - evaluation on the validation split (train.eval_every, and at the end), with ZeRO-3's
//     parameters gathered whole for its duration;
//   - checkpoints (checkpoint.every, at the end, and when preemption stops the run): the model,
//     optimizer state, RNG, loss scale, the extension's extras and the data position, after the
//     metrics rows of their step are durable;
//   - the profiler's window (train.profile_steps);
//   - graceful preemption (train/preemption.h): every rank leaves the loop before the same step.
// And the end of a run: the summary row and the plots.
//
// Thread-safety: the training thread only. Evaluation and the preemption vote are collective.
#pragma once

#include "train/profiler.h"
#include "train/run.h"

#include <map>
#include <memory>
#include <optional>
#include <string>

namespace parallax::train {
class PreemptionVote;
}

namespace parallax::train::detail {

// The validation metrics of the run's model as it is now (empty where the run does not evaluate:
// train/run.h Run::evaluates). Collective over dp; a preemption signal during it throws
// PreemptedError on every rank.
std::map<std::string, double> evaluate_run(Run& run);

class Cadence {
 public:
  // `total`: the run's last step. `loop`: false for a run without steps (no profiler window, no
  // preemption vote: only evaluate, save and finish are called).
  Cadence(Run& run, int64_t total, bool loop = true);
  ~Cadence();
  Cadence(const Cadence&) = delete;
  Cadence& operator=(const Cadence&) = delete;

  // Before step `step` trains: true (on every rank alike) when the run stops here for preemption,
  // after saving step - 1 where no checkpoint holds it.
  bool stop_before(int64_t step);
  // Around the step's work (the profiler's window).
  void before_step(int64_t step);
  void after_step(int64_t step);
  // After step `step`'s metrics: evaluation where it is due (returns true: the interval clock
  // restarts), then the checkpoint where it is due.
  bool evaluate_if_due(int64_t step);
  void save_if_due(int64_t step);

  // Evaluates and writes the "eval" row of `step`; a preemption signal stops it on every rank alike
  // (no row, preempted_during_eval() set).
  void evaluate(int64_t step);
  bool preempted_during_eval() const { return eval_preempted_; }
  // Saves checkpoint `step` (no-op without a checkpointer), after its metrics rows are durable.
  void save(int64_t step);
  // The step the run stopped after for preemption (-1: it did not).
  int64_t stopped_after() const { return stopped_after_; }
  // The loop is over: no more preemption votes.
  void loop_done();
  // Waits for the background checkpoint writes.
  void wait_for_saves();
  // The last rows and the plots (rank 0), after every rank finished.
  void finish(int64_t step, double loss, double samples_per_s, double wall_s);

 private:
  Run& run_;
  const int64_t total_;
  StepProfiler profiler_;
  std::unique_ptr<PreemptionVote> vote_;
  bool eval_preempted_ = false;
  int64_t stopped_after_ = -1;
  bool model_tensors_logged_ = false;
};

}  // namespace parallax::train::detail
