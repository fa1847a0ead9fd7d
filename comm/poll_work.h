// Internal: the Work of the CPU backends (MPI, gloo). PollWork completes by polling on the host:
// MPI and the CPU ring advance only while polled, so every wait polls every pending op of the
// process (WorldContext::progress_all) and times the op out at its ticket's deadline. Not part of
// the public API.
#pragma once

#include "comm/comm_base.h"

#include <exception>
#include <functional>
#include <memory>

namespace parallax::comm::detail {

// A Work completed by polling on the host (MPI and gloo). `poll` returns true once the backend op
// is done and throws CommError on a backend failure; `on_done` runs once afterwards (copy out of a
// staging buffer, divide for avg). `keep_alive` is buried if the op is abandoned.
class PollWork : public Work {
 public:
  using PollFn = std::function<bool()>;
  PollWork(std::shared_ptr<CommBase> comm, Ticket ticket, PollFn poll,
           std::function<void()> on_done = {}, std::shared_ptr<void> keep_alive = {});
  ~PollWork() override;

  void wait() override;
  bool is_completed() override;

 private:
  bool step();

  std::shared_ptr<CommBase> comm_;
  Ticket ticket_;
  PollFn poll_;
  std::function<void()> on_done_;
  std::shared_ptr<void> keep_alive_;
  bool done_ = false;
  std::exception_ptr error_;
};

}  // namespace parallax::comm::detail
