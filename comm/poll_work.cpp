// PollWork (poll_work.h): a CPU backend's op, completed by polling with the process-wide progress
// of every pending op, and failed with the hang report at its deadline.
#include "comm/poll_work.h"

#include <thread>

namespace parallax::comm::detail {

PollWork::PollWork(std::shared_ptr<CommBase> comm, Ticket ticket, PollFn poll,
                   std::function<void()> on_done, std::shared_ptr<void> keep_alive)
    : comm_(std::move(comm)),
      ticket_(std::move(ticket)),
      poll_(std::move(poll)),
      on_done_(std::move(on_done)),
      keep_alive_(std::move(keep_alive)) {}

PollWork::~PollWork() {
  // A pending op dropped without wait(): its buffers may still be in use by the backend.
  if (!done_ && keep_alive_) comm_->ctx()->bury(std::move(keep_alive_));
}

bool PollWork::step() {
  if (done_) return true;
  if (error_) std::rethrow_exception(error_);
  try {
    comm_->ctx()->progress_all();
    if (comm_->aborted()) {
      comm_->check_usable(op_name(ticket_.desc.kind));
    }
    bool finished = false;
    try {
      finished = poll_();
    } catch (const std::exception& e) {
      comm_->ctx()->bury(std::move(keep_alive_));
      comm_->fail_error(ticket_, e.what());
    }
    if (finished) {
      if (on_done_) on_done_();
      comm_->complete(ticket_);
      done_ = true;
      keep_alive_.reset();
      return true;
    }
    if (Clock::now() > ticket_.deadline) {
      comm_->ctx()->bury(std::move(keep_alive_));
      comm_->fail_timeout(ticket_);
    }
    return false;
  } catch (...) {
    error_ = std::current_exception();
    if (keep_alive_) comm_->ctx()->bury(std::move(keep_alive_));
    throw;
  }
}

void PollWork::wait() {
  // MPI and the CPU ring advance only while polled, so the loop keeps polling (yielding the core
  // between polls); only a wait that has already lasted seconds (a straggler) backs off to sleeps.
  int spins = 0;
  const auto start = Clock::now();
  while (!step()) {
    if (++spins < 64) continue;
    if (Clock::now() - start < std::chrono::seconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

bool PollWork::is_completed() {
  return step();
}

}  // namespace parallax::comm::detail
