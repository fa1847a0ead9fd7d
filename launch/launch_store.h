// The store protocol between the launcher agents of a `parallax launch` job (launch/agent.h lists
// its keys): node 0's agent hosts a c10d::TCPStore, every agent meets the others through counters
// (joins, completions, restarts, leaving) and records or reads each attempt's first failure.
//
// Every call has a deadline of --rdzv-timeout: c10d's client calls have none, and a store host
// that is stopped (SIGSTOP, a hung node), not dead, would otherwise keep a launcher waiting
// forever. Errors are CommError naming this node, the store's address and the call. Not
// thread-safe; one per agent.
#pragma once

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <utility>

namespace parallax::launch {

// Why an attempt ended: a worker failed (restartable), failed deterministically (config, layout or
// data error: not restarted), or stopped for preemption.
enum class FailureKind { kFail, kDeterministic, kPreempt };

struct Failure {
  FailureKind kind = FailureKind::kFail;
  int node = 0;
  std::string text;
};

class LaunchStore {
 public:
  using Clock = std::chrono::steady_clock;

  // Hosts (`node_rank` 0) or reaches the store at addr:port within `timeout_s` (port 0 on node 0:
  // a free port). `poll_s`: how often wait_counter() looks. Throws CommError.
  LaunchStore(std::string addr, int port, int node_rank, double timeout_s, double poll_s);

  // The store's port (the one chosen when 0 was asked for).
  int port() const { return port_; }

  // Adds `add` to counter `key` and returns its new value (add 0 to read it).
  int64_t counter(const std::string& key, int64_t add);
  // Waits until counter `key` reaches `target`; false on `deadline`, or when `stop()` is true.
  template <class Stop>
  bool wait_counter(const std::string& key, int64_t target, Clock::time_point deadline, Stop stop) {
    while (counter(key, 0) < target) {
      if (Clock::now() > deadline || stop()) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(poll_s_ * 1000)));
    }
    return true;
  }

  // The first failure recorded for `attempt`, if any.
  std::optional<Failure> read_failure(int attempt);
  // Records `f` (of this node) as attempt's failure unless another was first; returns the recorded
  // one and whether it is ours.
  std::pair<Failure, bool> record_failure(int attempt, const Failure& f);

 private:
  // Runs the store call `f` (which must own what it uses: it is copied into a helper thread)
  // within the deadline. On the deadline the helper thread is left blocked (detached; it owns its
  // copies) and the error names the store and the call.
  template <class F>
  auto call(const char* what, F f) -> decltype(f());

  std::string addr_;
  int port_ = 0;
  int node_rank_ = 0;
  double timeout_s_ = 0;
  double poll_s_ = 0;
  c10::intrusive_ptr<c10d::TCPStore> store_;
};

}  // namespace parallax::launch
