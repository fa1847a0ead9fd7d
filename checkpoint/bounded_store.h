// Internal: the out-of-band store of a save (the World's c10d store), every call with a deadline.
// c10d's TCPStore client calls have none of their own: a store whose host is stopped (SIGSTOP, a
// hung node) keeps a call waiting forever. So each call runs on a helper thread that owns copies
// of what it uses, and is given up after its deadline (the helper is left behind, detached).
//
// Errors: the first call that times out (TimeoutError naming the store's host: "world rank 0 did
// not arrive") or fails (CommError with the store's message) marks the store lost: later calls
// fail at once with a CommError instead of each waiting out a deadline (and never share the
// connection with the abandoned helper), and `on_lost` runs once, on the calling thread.
//
// Thread-safety: none; one BoundedStore per thread of use (the Checkpointer's writer owns one).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace parallax::checkpoint {

// The clock of every checkpoint deadline.
using Clock = std::chrono::steady_clock;
// `s` seconds as a Clock duration.
Clock::duration seconds(double s);

class BoundedStore {
 public:
  BoundedStore() = default;
  // `host` names the store's host in messages ("hosted by world rank 0", "the launcher's store");
  // every call but wait() has `timeout_s` as its deadline.
  BoundedStore(c10::intrusive_ptr<c10d::Store> store, int rank, std::string host, double timeout_s,
               std::function<void()> on_lost);

  // `what` says what the call is for, in messages ("save of step 10: publishing the result").
  void set(const std::string& k, const std::string& v, const std::string& what);
  std::string get(const std::string& k, const std::string& what);
  int64_t add(const std::string& k, int64_t n, const std::string& what);
  bool check(const std::string& k, const std::string& what);
  void remove(const std::string& k, const std::string& what);
  // Waits up to `timeout_s` for `k` to exist. A store that answers "not yet" at the timeout throws
  // a CommError carrying its text; one that does not answer at all, a TimeoutError.
  void wait(const std::string& k, double timeout_s, const std::string& what);
  // A connection of its own to the same store (TCPStore::clone).
  c10::intrusive_ptr<c10d::Store> clone(const std::string& what);

 private:
  template <class F>
  auto run(const std::string& what, double deadline_s, F f) -> decltype(f());
  // Who did not arrive when the store does not answer: the rank whose process hosts it, if any.
  std::string absent_host() const;
  void lose(const std::string& why);

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_ = 0;
  std::string host_;
  double timeout_s_ = 1800;
  std::function<void()> on_lost_;
  std::optional<std::string> lost_;
};

}  // namespace parallax::checkpoint
