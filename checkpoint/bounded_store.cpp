#include "checkpoint/bounded_store.h"

#include "comm/deadline_call.h"
#include "core/error.h"
#include "core/strings.h"

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <vector>

namespace parallax::checkpoint {
namespace {

std::string store_text(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}
std::vector<uint8_t> store_bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

}  // namespace

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

BoundedStore::BoundedStore(c10::intrusive_ptr<c10d::Store> store, int rank, std::string host,
                           double timeout_s, std::function<void()> on_lost)
    : store_(std::move(store)),
      rank_(rank),
      host_(std::move(host)),
      timeout_s_(timeout_s),
      on_lost_(std::move(on_lost)) {}

template <class F>
auto BoundedStore::run(const std::string& what, double deadline_s, F f) -> decltype(f()) {
  using R = decltype(f());
  if (lost_) {
    throw_error<CommError>(
        "rank {}: the checkpoint store ({}) is unusable since an earlier "
        "call: {} (during {})",
        rank_, host_, *lost_, what);
  }
  std::optional<R> r;
  try {
    r = comm::call_with_deadline(std::move(f), Clock::now() + seconds(deadline_s));
  } catch (const std::exception& e) {
    const std::string text = comm::one_line_what(e);
    lose(text);
    throw_error<CommError>("rank {}: the checkpoint store ({}) failed during {}: {}", rank_, host_,
                           what, text);
  }
  if (!r) {
    lose(fmt::format("no answer within {:.0f} s", deadline_s));
    throw_error<TimeoutError>(
        "rank {}: the checkpoint store ({}) did not answer within the checkpoint timeout "
        "({:.0f} s, parallel.checkpoint_timeout_s) during {}: {}",
        rank_, host_, timeout_s_, what, absent_host());
  }
  return std::move(*r);
}

void BoundedStore::set(const std::string& k, const std::string& v, const std::string& what) {
  run(what, timeout_s_, [s = store_, k, v = store_bytes(v)] {
    s->set(k, v);
    return 0;
  });
}

std::string BoundedStore::get(const std::string& k, const std::string& what) {
  return run(what, timeout_s_, [s = store_, k] { return store_text(s->get(k)); });
}

int64_t BoundedStore::add(const std::string& k, int64_t n, const std::string& what) {
  return run(what, timeout_s_, [s = store_, k, n] { return s->add(k, n); });
}

bool BoundedStore::check(const std::string& k, const std::string& what) {
  return run(what, timeout_s_, [s = store_, k] { return s->check({k}); });
}

void BoundedStore::remove(const std::string& k, const std::string& what) {
  run(what, timeout_s_, [s = store_, k] { return s->deleteKey(k); });
}

void BoundedStore::wait(const std::string& k, double timeout_s, const std::string& what) {
  const auto t = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  // The store's own timeout first; ours only catches a store that stopped answering.
  run(what, timeout_s + std::min(10.0, 1.0 + timeout_s / 10), [s = store_, k, t] {
    s->wait({k}, t);
    return 0;
  });
}

c10::intrusive_ptr<c10d::Store> BoundedStore::clone(const std::string& what) {
  return run(what, timeout_s_, [s = store_] { return s->clone(); });
}

std::string BoundedStore::absent_host() const {
  const std::string tag = "hosted by ";
  if (core::starts_with(host_, tag))
    return host_.substr(tag.size()) + " did not arrive (stopped, hung or dead)";
  return "its host is stopped, hung or dead";
}

void BoundedStore::lose(const std::string& why) {
  if (lost_) return;
  lost_ = why;
  if (on_lost_) on_lost_();
}

}  // namespace parallax::checkpoint
