// Internal to the trainer (train/trainer.h is the API): one optimizer step of a run (train/run.h),
// eagerly or as a CUDA graph (train.cuda_graph): the micro-batches drawn, the model's forward and
// loss under the precision policy's autocast, the extension's loss terms, the engine's step over
// the micro-batches (whole, or as a chain of units for pipeline stages), then the precision
// policy's unscale and inf check, clipping, the engine's update and the policy's end of step.
//
// Thread-safety: the training thread only.
#pragma once

#include "core/tensor_dict.h"
#include "models/replica_mean.h"
#include "train/run.h"

#include <ATen/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace parallax::train::detail {

// What a step measured, summed over the steps since the last reset (StepMetrics reads them).
struct StepTimes {
  double data_ms = 0;      // drawing and copying batches
  double comm_ms = 0;      // communication the engine could not overlap
  double backward_ms = 0;  // the engine's backward, where it times it (Engine::timed)
  void reset() { data_ms = comm_ms = backward_ms = 0; }
};

class StepRunner {
 public:
  explicit StepRunner(Run& run);

  // Optimizer step `step` at learning rate `lr`: returns this rank's loss terms (device tensors,
  // averaged over the micro-batches). `log_step`: the gradient norm is needed for the metrics
  // (without clipping it is computed only then).
  std::map<std::string, at::Tensor> run(int64_t step, double lr, bool log_step);
  // Waits for the last replayed CUDA graph (no-op without one).
  void drain();

  StepTimes& times() { return times_; }
  // The gradient norm of the last step that computed it (undefined otherwise).
  const at::Tensor& grad_norm() const { return grad_norm_; }

 private:
  std::map<std::string, at::Tensor> eager_step(int64_t step, double lr, bool log_step);
  std::map<std::string, at::Tensor> graph_step(int64_t step, double lr, bool log_step);
  // Forward, backward, unscale, clip and optimizer step on the micro-batches batch_of(0..K-1).
  // Leaves the gradients in place. No host synchronisation on GPUs unless fp16 loss scaling is on.
  std::map<std::string, at::Tensor> compute_step(
      const std::function<core::TensorDict(int)>& batch_of, double lr, bool log_step);
  // graph_step's inputs: the source's next micro-batches copied into graph_inputs_ (which the
  // first call allocates); a DataError names a key whose shape differs from the captured one.
  void stage_graph_inputs(int64_t step);
  // Runs a graph launch or drain. A replay that never finished (a peer stopped inside a captured
  // collective) leaves this process's streams and communicators stuck, so no graceful shutdown is
  // possible: the error is printed and the job is torn down (World::abort, MPI_Abort under mpirun).
  void replay_or_abort(const std::function<void()>& launch);
  // After the first step (gradients exist): what every rank's engine holds, as one metrics row of
  // kind "memory", which `parallax plan` predicts exactly. Collective over the world.
  void record_engine_memory(int64_t step);

  Run& run_;
  // Mean over the data-parallel group, installed on the model around each step (empty with one
  // data-parallel rank); see models::Model::set_replica_mean.
  models::ReplicaMean replica_mean_;
  StepTimes times_;
  at::Tensor grad_norm_;
  // train.cuda_graph: the captured input buffers (one batch per micro-step) and the captured
  // step's loss terms (overwritten by each replay).
  std::vector<core::TensorDict> graph_inputs_;
  std::map<std::string, at::Tensor> graph_terms_;
};

}  // namespace parallax::train::detail
