// Deadlines for calls that have none of their own. c10d's TCPStore client calls (get, add, wait,
// ...) block until the store answers: a store whose host is stopped (SIGSTOP, a hung node), not
// dead, keeps such a call waiting forever. Every store call of the world, the checkpointer and the
// launcher goes through call_with_deadline, and their messages through one_line_what.
#pragma once

#include <chrono>
#include <exception>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

namespace parallax::comm {

// Runs `f` on a helper thread and waits for it until `deadline`. Returns f's result, or
// std::nullopt when the deadline passed first: the helper is then left behind (detached), blocked
// in the call until the process exits, so `f` must own everything it uses (capture copies, e.g. of
// the store's intrusive_ptr). Rethrows whatever `f` threw. `f` must return a value.
template <class F>
auto call_with_deadline(F f, std::chrono::steady_clock::time_point deadline)
    -> std::optional<decltype(f())> {
  using R = decltype(f());
  auto done = std::make_shared<std::promise<R>>();
  std::future<R> result = done->get_future();
  std::thread([f = std::move(f), done]() mutable {
    try {
      done->set_value(f());
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  if (result.wait_until(deadline) != std::future_status::ready) return std::nullopt;
  return result.get();
}

// One line of an exception's text, for a user-facing message: a c10::Error without its C++
// backtrace ("Exception raised from ... at /__w/pytorch/...", then "frame #..." lines), cut at the
// first line break and clipped to 300 characters.
std::string one_line_what(const std::exception& e);

}  // namespace parallax::comm
