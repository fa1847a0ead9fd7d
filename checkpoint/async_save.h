// Internal: the background writer of async saves. A save is snapshotted into host buffers owned
// here (reused between saves; pinned for CUDA sources, so the copy is asynchronous and the device
// is synchronised once), then written and committed by one worker thread while training goes on.
// Host memory is therefore one snapshot of this rank's owned entries.
//
// Errors: the worker's exception is kept and rethrown, once, by the join() that collects it; it is
// never dropped.
//
// Thread-safety: every member is called from one thread (the training thread); at most one save
// runs in the background (start() requires that the previous one was joined).
#pragma once

#include "checkpoint/checkpointer.h"
#include "checkpoint/commit.h"

#include <ATen/core/Tensor.h>

#include <atomic>
#include <exception>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <thread>

namespace parallax::checkpoint {

class AsyncSaveWorker {
 public:
  AsyncSaveWorker() = default;
  // Joins a save in flight; its result and error are dropped (collect them with join() first).
  ~AsyncSaveWorker();
  AsyncSaveWorker(const AsyncSaveWorker&) = delete;
  AsyncSaveWorker& operator=(const AsyncSaveWorker&) = delete;

  // Copies the tensors of `job` into this worker's host buffers and points the entries at them;
  // returns once the copies are complete. Buffers of entries the job no longer has are freed.
  SaveJob snapshot(SaveJob job);
  // Runs `save(job)` on the worker thread. Requires !running().
  void start(SaveJob job, std::function<SaveStats(SaveJob&)> save);
  // A save was started and not joined yet.
  bool running() const { return running_; }
  // A save was started and has finished (join() will not block).
  bool finished() const { return running_ && done_.load(); }
  // Waits for the save in flight and returns its stats; rethrows its error. nullopt when no save
  // is running.
  std::optional<SaveStats> join();

 private:
  std::thread thread_;
  bool running_ = false;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;  // written by the worker before done_, read after the join
  SaveStats stats_;
  // Host buffers by dataset path (one per piece of a tensor).
  std::map<std::string, at::Tensor> snapshots_;
};

}  // namespace parallax::checkpoint
