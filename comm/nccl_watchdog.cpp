#ifdef PARALLAX_WITH_NCCL

// The nccl backend: the watchdog, timeouts, abort and shutdown; NcclWork (nccl_internal.h has the
// class).
#include "comm/nccl_internal.h"

#include <algorithm>
#include <chrono>

namespace parallax::comm::detail::nccl {

namespace {

// Aborts the data communicator and its control twin in one NCCL group. Each ncclCommAbort first
// raises its communicator's abort flag, which makes that communicator's kernels quit, and then
// frees its resources, and freeing pinned host memory (cudaFreeHost) waits for the whole device.
// One after the other, the first abort's free waits for the second communicator's kernel, which
// spins on for a peer that never comes because its flag is not up yet: seen on 2 x H200, where a
// pipeline stage's watchdog hung in ncclCommAbort(comm_) while its receive on the control twin
// waited for the stopped stage. Inside one group both flags go up before anything is freed (the
// group's end runs the reclaim jobs; a group of aborts is a blocking group even with a
// non-blocking member).
void abort_together(ncclComm_t data, ncclComm_t control) noexcept {
  if (!control) {
    if (data) ncclCommAbort(data);
    return;
  }
  if (!data) {
    ncclCommAbort(control);
    return;
  }
  ncclGroupStart();
  ncclCommAbort(data);
  ncclCommAbort(control);
  ncclGroupEnd();
}

}  // namespace

void NcclCommunicator::release_backend() noexcept {
  if (released_) return;
  released_ = true;
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    stop_ = true;
  }
  watchdog_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (comm_aborted_ || !comm_) return;
  // Graceful: let enqueued work drain (bounded), finalize, destroy; abort if any step fails.
  try {
    c10::cuda::CUDAGuard g(device_);
    const auto deadline = after(options_.timeout_s);
    while (cudaStreamQuery(stream_.stream()) == cudaErrorNotReady) {
      if (Clock::now() > deadline) throw TimeoutError("comm stream did not drain");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ncclResult_t rc = ncclCommFinalize(comm_);
    if (rc != ncclSuccess && rc != ncclInProgress) throw CommError(nccl_error(rc, comm_));
    wait_ready(comm_, after(options_.init_timeout_s), "ncclCommFinalize");
    ncclCommDestroy(comm_);
    comm_ = nullptr;
    if (ctrl_) {
      rc = ncclCommFinalize(ctrl_);
      if (rc != ncclSuccess && rc != ncclInProgress) throw CommError(nccl_error(rc, ctrl_));
      wait_ready(ctrl_, after(options_.init_timeout_s), "ncclCommFinalize (control)");
      ncclCommDestroy(ctrl_);
      ctrl_ = nullptr;
    }
  } catch (const std::exception& e) {
    core::log::warn("group '{}': NCCL communicator did not shut down cleanly ({}); aborting it",
                    name_, e.what());
    abort_together(comm_, ctrl_);
  }
  comm_ = nullptr;
  ctrl_ = nullptr;
}

void NcclCommunicator::timeout(const std::shared_ptr<Pending>& p) {
  std::lock_guard<std::mutex> lock(fail_mu_);
  if (aborted_) {
    if (p->timed_out) throw TimeoutError(failure_message());
    throw CommError(failure_message());
  }
  p->timed_out = true;
  fail_timeout(p->tickets[0]);
}

void NcclCommunicator::rethrow_failure(const std::shared_ptr<Pending>& p) {
  if (p->timed_out) throw TimeoutError(failure_message());
  check_usable("wait");
  throw CommError(failure_message());
}

void NcclCommunicator::mark_completed(const std::shared_ptr<Pending>& p) {
  if (p->completed.exchange(true) || p->internal) return;
  for (const auto& t : p->tickets) complete(t);
}

void NcclCommunicator::abort_backend() noexcept {
  std::lock_guard<std::mutex> lock(abort_mu_);
  if (comm_ && !comm_aborted_) {
    abort_together(comm_, ctrl_);
    comm_aborted_ = true;
  }
}

void NcclCommunicator::watchdog() {
  this_thread_is_backends();
  try {
    c10::cuda::CUDAGuard g(device_);
    std::unique_lock<std::mutex> lock(pending_mu_);
    while (!stop_) {
      watchdog_cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; });
      if (stop_) break;
      std::vector<std::shared_ptr<Pending>> list(pending_.begin(), pending_.end());
      lock.unlock();
      std::vector<Pending*> done;
      for (auto& p : list) {
        if (p->completed || p->end->query()) {
          mark_completed(p);
          done.push_back(p.get());
        } else if (Clock::now() > p->tickets[0].deadline && !aborted_) {
          try {
            timeout(p);
          } catch (const std::exception&) {
            // Recorded (flight recorder, aborted communicator); the waiter or the next op
            // throws it.
          }
        }
      }
      for (ncclComm_t c : {comm_, ctrl_}) {
        if (aborted_ || !c || comm_aborted_ || list.empty()) break;
        ncclResult_t state = ncclSuccess;
        if (ncclCommGetAsyncError(c, &state) == ncclSuccess && state != ncclSuccess &&
            state != ncclInProgress) {
          std::lock_guard<std::mutex> fl(fail_mu_);
          if (!aborted_) {
            try {
              fail_error(list.front()->tickets[0],
                         fmt::format("asynchronous NCCL error: {}", nccl_error(state, c)));
            } catch (const std::exception&) {
            }
          }
        }
      }
      lock.lock();
      pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                    [&](const std::shared_ptr<Pending>& p) {
                                      return std::find(done.begin(), done.end(), p.get()) !=
                                                 done.end() ||
                                             aborted_;
                                    }),
                     pending_.end());
    }
  } catch (const std::exception& e) {
    core::log::error("group '{}': NCCL watchdog stopped: {}", name_, e.what());
  }
}

bool NcclWork::poll() {
  PARALLAX_CHECK(!p_->captured, CommError,
                 "group '{}' (rank {}): a collective captured into a CUDA graph has no completion "
                 "to wait for on the "
                 "host (it runs when the graph is replayed); use wait_stream()",
                 comm_->name(), comm_->rank());
  if (p_->completed) return true;
  if (comm_->aborted()) comm_->rethrow_failure(p_);
  c10::cuda::CUDAGuard g(comm_->device());
  if (p_->end->query()) {
    comm_->mark_completed(p_);
    return true;
  }
  if (Clock::now() > p_->tickets[0].deadline) comm_->timeout(p_);
  return false;
}

void NcclWork::wait() {
  // Spin (yielding) for the first millisecond, then poll every 20 us: a fixed 50 us sleep added up
  // to 50 us to every blocking collective.
  const auto start = Clock::now();
  while (!poll()) {
    if (Clock::now() - start < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  wait_stream();
}

void NcclWork::wait_stream() {
  if (comm_->aborted() && !p_->completed) comm_->rethrow_failure(p_);
  c10::cuda::CUDAGuard g(comm_->device());
  p_->end->block(c10::cuda::getCurrentCUDAStream(comm_->device().index()));
}

bool NcclWork::is_completed() {
  return poll();
}

}  // namespace parallax::comm::detail::nccl

#endif  // PARALLAX_WITH_NCCL
