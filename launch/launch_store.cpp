// The store protocol between launcher agents (launch_store.h): bounded store calls, counters, and
// each attempt's first failure as "<kind>|<node>|<text>".
#include "launch/launch_store.h"

#include "comm/deadline_call.h"
#include "core/error.h"
#include "core/strings.h"

#include <fmt/format.h>

#include <cstdlib>
#include <vector>

namespace parallax::launch {
namespace {

const char* kind_name(FailureKind k) {
  switch (k) {
    case FailureKind::kFail:
      return "fail";
    case FailureKind::kDeterministic:
      return "deterministic";
    case FailureKind::kPreempt:
      return "preempt";
  }
  return "fail";
}

FailureKind kind_of(const std::string& name) {
  if (name == "deterministic") return FailureKind::kDeterministic;
  if (name == "preempt") return FailureKind::kPreempt;
  return FailureKind::kFail;
}

std::string bytes_str(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}
std::vector<uint8_t> str_bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

}  // namespace

LaunchStore::LaunchStore(std::string addr, int port, int node_rank, double timeout_s, double poll_s)
    : addr_(std::move(addr)), node_rank_(node_rank), timeout_s_(timeout_s), poll_s_(poll_s) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = node_rank == 0;
  so.waitWorkers = false;
  so.numWorkers = std::nullopt;
  so.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  try {
    store_ = c10::make_intrusive<c10d::TCPStore>(addr_, so);
  } catch (const std::exception& e) {
    throw_error<CommError>(
        "launch: node {}: cannot {} the launcher store at {}:{} within {:.0f} s: {}", node_rank,
        so.isServer ? "host" : "reach", addr_, port, timeout_s, comm::one_line_what(e));
  }
  port_ = store_->getPort();
}

template <class F>
auto LaunchStore::call(const char* what, F f) -> decltype(f()) {
  try {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s_));
    if (auto r = comm::call_with_deadline(std::move(f), deadline)) return *r;
  } catch (const std::exception& e) {
    throw_error<CommError>(
        "launch: node {}: the launcher store at {}:{} failed during {} (did node 0's launcher "
        "end?): {}",
        node_rank_, addr_, port_, what, comm::one_line_what(e));
  }
  throw_error<CommError>(
      "launch: node {}: the launcher store at {}:{} did not answer within {:.0f} s "
      "(--rdzv-timeout) during {}: is node 0's launcher stopped or its host hung?",
      node_rank_, addr_, port_, timeout_s_, what);
}

int64_t LaunchStore::counter(const std::string& key, int64_t add) {
  return call("a counter update", [s = store_, key, add] { return s->add(key, add); });
}

std::optional<Failure> LaunchStore::read_failure(int attempt) {
  const std::string key = fmt::format("launch/failed/{}", attempt);
  if (!call("a failure check", [s = store_, key] { return s->check({key}); })) return std::nullopt;
  const std::string v =
      bytes_str(call("a failure read", [s = store_, key] { return s->get(key); }));
  const auto parts = core::split(v, '|');
  Failure f;
  if (parts.size() >= 3) {
    f.kind = kind_of(parts[0]);
    f.node = std::atoi(parts[1].c_str());
    f.text = v.substr(parts[0].size() + parts[1].size() + 2);
  } else {
    f.text = v;
  }
  return f;
}

std::pair<Failure, bool> LaunchStore::record_failure(int attempt, const Failure& f) {
  const std::string key = fmt::format("launch/failed/{}", attempt);
  const std::string mine = fmt::format("{}|{}|{}", kind_name(f.kind), node_rank_, f.text);
  const std::string now =
      bytes_str(call("recording a failure",
                     [s = store_, key, v = str_bytes(mine)] { return s->compareSet(key, {}, v); }));
  if (now == mine) return {f, true};
  return {*read_failure(attempt), false};
}

}  // namespace parallax::launch
