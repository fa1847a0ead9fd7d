// Graceful preemption of a training job (docs/launch.md): the first SIGTERM or SIGINT asks the
// job to stop after the current step, save a checkpoint and exit with the preemption code; a
// second one exits at once. Works the same under `parallax launch` (which forwards its signals),
// srun, mpirun, torchrun or alone.
//
// Two parts:
//  - PreemptionSignals (RAII, one per process, installed by `parallax train`, `eval` and
//    `export`): an async-signal-safe handler that only sets a process-wide flag and writes one line
//    to stderr; a second signal restores the default action and re-raises it. A repeat within 2 s
//    of the first counts as the same one (Slurm signals every process of a step while `parallax
//    launch` forwards its own copy). The destructor restores the previous handlers.
//  - Other loops (docs/launch.md, "Graceful preemption"): QAT calibration checks the flag before
//    every batch (agreed over the data-parallel group by a PreemptionVote), evaluation before every
//    batch (each rank stops where it is; the first collective after the loop tells every rank),
//    and `parallax export` between parity frames and while ONNX Runtime runs. They stop by
//    throwing PreemptedError on every rank alike: the trainer then saves what a checkpoint can
//    hold (nothing, when no step has run) and exits kExitPreempted; `parallax eval` and `parallax
//    export` write nothing and exit kExitPreempted.
//  - PreemptionVote: the ranks' agreement on the step to stop at. Signals reach ranks at different
//    times (or one rank only), yet every rank must leave the loop after the same step, or the
//    checkpoint save, a collective, would hang. Each step every rank contributes its flag to a
//    one-element MAX all-reduce over the world, issued asynchronously; the result of step s's vote
//    is read at step s + 1 (a one-step lag), so on GPUs the host never waits for the step that is
//    running: only for the tiny all-reduce enqueued before it (a pinned copy and a device event).
//    Every rank reads the same vote at the same step, so all stop after the same step. Cost: one
//    4-byte all-reduce per step (tens of microseconds on gloo, NCCL or MPI).
#pragma once

#include "core/error.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

namespace parallax::comm {
class Communicator;
}

namespace parallax::train {

// The exit code of a process (and of `parallax launch`) that stopped for preemption after saving
// its checkpoint: 128 + SIGTERM, what a shell reports for a job ended by SIGTERM.
inline constexpr int kExitPreempted = 143;

// A loop other than the training steps (calibration, evaluation, export) stopped for a preemption
// signal; thrown alike on every rank of the collective it was in. The message says where it
// stopped and what was (not) saved.
class PreemptedError : public Error {
 public:
  explicit PreemptedError(std::string message) : Error(std::move(message)) {}
};

class PreemptionSignals {
 public:
  // Installs the SIGTERM and SIGINT handlers and clears the flag. `action`: what the first signal
  // does, for the line the handler prints ("stopping after the current step (checkpoint, then
  // exit 143)" when null); a string literal (the handler reads it).
  explicit PreemptionSignals(const char* action = nullptr);
  ~PreemptionSignals();  // restores the previous handlers
  PreemptionSignals(const PreemptionSignals&) = delete;
  PreemptionSignals& operator=(const PreemptionSignals&) = delete;

  // True while a PreemptionSignals exists in this process: the trainer then votes each step
  // (every rank runs the same verb, so all agree on it).
  static bool installed();
  // True once a SIGTERM or SIGINT arrived (thread-safe; lock-free).
  static bool requested();
  // The signal number that arrived first (0: none).
  static int signal_number();
  // Sets the flag as a signal would (tests).
  static void request_for_test();

 private:
  struct Saved;
  std::unique_ptr<Saved> saved_;
};

// True once a training loop of this process stopped early for preemption (after its save):
// `parallax train` then exits with kExitPreempted.
bool preempted();
void mark_preempted();

class PreemptionVote {
 public:
  // `world`: the communicator every rank of the job is in; `device`: where its collectives run.
  // `timeout_s`: deadline for reading a vote (the collective's own timeout applies too).
  PreemptionVote(comm::Communicator& world, c10::Device device, double timeout_s);
  PreemptionVote(const PreemptionVote&) = delete;
  PreemptionVote& operator=(const PreemptionVote&) = delete;

  // Waits for the outstanding vote, unless an exception is unwinding (then its buffers are left
  // allocated for the backend rather than waiting up to a collective timeout).
  ~PreemptionVote();
  // Collective: every rank calls it once per loop iteration, before the iteration's step.
  // Returns true, on every rank at the same call, when the vote issued at the previous call
  // found a signal on any rank: the caller then saves and stops before training this step.
  // Then issues this call's vote. Throws CommError/TimeoutError like any collective.
  bool should_stop();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace parallax::train
