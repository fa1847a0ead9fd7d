// Whole-step CUDA graph capture for the trainer (`train.cuda_graph: true`).
//
// A captured step replays forward, backward, DDP's bucket all-reduces (NCCL kernels captured into
// the graph), gradient clipping and the optimizer as one graph launch: the host's per-kernel
// launch cost (~150-190 us per ViT-B layer in cuDNN attention's backward alone) leaves the step's
// critical path. What it needs from the rest of the code, and what trainer.cpp arranges:
// - static shapes and addresses: inputs are copied into buffers captured once; outputs (the loss
//   terms) and gradients are the graph's own tensors, overwritten by each replay;
// - no host synchronisation inside the step (no `.item()`, no blocking collective): the fp16 loss
//   scaler and DDP's find_unused are refused with train.cuda_graph;
// - values that change between steps read from device memory: the learning rate is a device
//   tensor the optimizer reads (Optimizer::set_capturable), written before each replay;
// - a side stream: capture cannot run on the legacy default stream, so the whole run (warm-up
//   steps included, so lazily created cuBLAS workspaces belong to it) runs on one.
//
// Capture uses cudaStreamCaptureModeThreadLocal: only the training thread is held to
// capture-safe calls; autograd's device thread launches into the capturing stream (and is
// captured), and the NCCL watchdog keeps polling its own eager ops.
//
// A replay cannot be watched kernel by kernel, so replay() bounds the whole step instead: before
// launching step n it waits (polling) for step n-2 to finish, at most `timeout_s`, and throws
// TimeoutError naming the rank and step otherwise (a peer died or a captured collective hangs).
// The host thus stays at most two steps ahead of the GPU.
//
// Builds without CUDA: the constructor throws ConfigError. Thread-safety: training thread only.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace parallax::train {

class CudaStepGraph {
 public:
  // Makes a fresh side stream of `device` current on this thread until destruction (after the
  // device's pending work on the previous stream has finished).
  CudaStepGraph(c10::Device device, int rank, double timeout_s);
  ~CudaStepGraph();
  CudaStepGraph(const CudaStepGraph&) = delete;
  CudaStepGraph& operator=(const CudaStepGraph&) = delete;

  // Records `body` into the graph without running it. `body` must leave no work on other streams
  // that the side stream has not waited for (DDP's finalize_backward joins the comm stream).
  void capture(const std::function<void()>& body);
  bool captured() const;
  // Launches the graph as step `step` (bounded as described above).
  void replay(int64_t step);
  // Waits (bounded) until every launched replay has finished.
  void drain();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace parallax::train
