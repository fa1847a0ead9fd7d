// SeqBoard (seq_board.h): the writer thread that publishes each group's last collective and the
// heartbeat, and the bounded reads a hang report makes.
#include "comm/seq_board.h"

#include "core/error.h"
#include "core/log.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>

namespace parallax::comm::detail {

struct SeqBoard::Shared {
  c10::intrusive_ptr<c10d::Store> writer;  // used by the writer thread only
  c10::intrusive_ptr<c10d::Store> reader;  // used by publish_now() and read()'s helper threads
  std::mutex mu;
  std::mutex reader_mu;
  std::condition_variable cv;
  struct Update {
    uint64_t seq = 0;
    std::function<std::string()> summary;
  };
  std::map<std::string, Update> pending;  // key -> newest update
  bool stop = false;
  bool flush_requested = false;
  bool writing = false;
  bool broken = false;
  bool exited = false;
  int world_rank = 0;
  uint64_t beats = 0;  // heartbeat counter
};

SeqBoard::SeqBoard(const c10::intrusive_ptr<c10d::Store>& store, int world_rank)
    : shared_(std::make_shared<Shared>()), world_rank_(world_rank) {
  shared_->reader = store;
  shared_->world_rank = world_rank;
  try {
    shared_->writer = store->clone();
  } catch (const std::exception& e) {
    core::log::debug("seq board: store clone failed ({}); sharing the connection", e.what());
    shared_->writer = store;
  }
  thread_ = std::thread([s = shared_] { run(s); });
}

SeqBoard::~SeqBoard() {
  std::unique_lock<std::mutex> lock(shared_->mu);
  shared_->stop = true;
  shared_->cv.notify_all();
  // A writer stuck in a store call (its host stopped) is left behind holding the shared state.
  const bool exited = shared_->cv.wait_for(lock, kStopWait, [this] { return shared_->exited; });
  lock.unlock();
  if (exited) {
    thread_.join();
  } else {
    core::log::debug(
        "seq board: the writer did not stop within {} ms (store unreachable); left behind",
        kStopWait.count());
    thread_.detach();
  }
}

std::string SeqBoard::key(const std::string& uid, int rank) {
  return fmt::format("pxc/seq/{}/{}", uid, rank);
}

void SeqBoard::publish(const std::string& uid, uint64_t seq, std::function<std::string()> summary) {
  std::lock_guard<std::mutex> lock(shared_->mu);
  if (shared_->broken) return;
  shared_->pending[key(uid, world_rank_)] = Shared::Update{seq, std::move(summary)};
}

void SeqBoard::publish_now(const std::string& uid, uint64_t seq, const std::string& summary) {
  const std::string v = fmt::format("{}|{}", seq, summary);
  std::lock_guard<std::mutex> lock(shared_->reader_mu);
  shared_->reader->set(key(uid, world_rank_), std::vector<uint8_t>(v.begin(), v.end()));
}

void SeqBoard::flush(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(shared_->mu);
  shared_->flush_requested = true;
  shared_->cv.notify_all();
  shared_->cv.wait_for(lock, timeout, [this] {
    return (shared_->pending.empty() && !shared_->writing) || shared_->broken || shared_->stop;
  });
}

std::vector<std::optional<std::string>> SeqBoard::read_keys(const std::vector<std::string>& keys,
                                                            std::chrono::milliseconds timeout) {
  // The store calls run on a helper thread: if the store's host is stopped they never return, and
  // this rank must still report and exit. The helper owns what it touches (shared state, result).
  struct Result {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::vector<std::optional<std::string>> values;
    std::exception_ptr error;
  };
  auto result = std::make_shared<Result>();
  std::thread([s = shared_, result, keys] {
    std::vector<std::optional<std::string>> out(keys.size());
    std::exception_ptr error;
    try {
      std::lock_guard<std::mutex> lock(s->reader_mu);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        if (s->reader->check({keys[i]})) {
          const auto v = s->reader->get(keys[i]);
          out[i] = std::string(v.begin(), v.end());
        }
      }
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(result->mu);
    result->values = std::move(out);
    result->error = error;
    result->done = true;
    result->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(result->mu);
  if (!result->cv.wait_for(lock, timeout, [&] { return result->done; })) {
    throw_error<TimeoutError>(
        "the store did not answer within {:.1f} s (its host, world rank 0 or the launcher, "
        "is stopped, dead or unreachable)",
        timeout.count() / 1000.0);
  }
  if (result->error) std::rethrow_exception(result->error);
  return result->values;
}

std::map<int, SeqBoard::PeerState> SeqBoard::read(const std::string& uid,
                                                  const std::vector<int>& world_ranks,
                                                  std::chrono::milliseconds timeout) {
  std::vector<std::string> keys;
  for (int r : world_ranks) keys.push_back(key(uid, r));
  const auto values = read_keys(keys, timeout);
  std::map<int, PeerState> out;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    PeerState st;
    if (values[i]) {
      const std::string& text = *values[i];
      const auto bar = text.find('|');
      st.known = true;
      st.seq = std::strtoull(text.substr(0, bar).c_str(), nullptr, 10);
      st.summary = bar == std::string::npos ? "" : text.substr(bar + 1);
    }
    out[world_ranks[i]] = st;
  }
  return out;
}

std::vector<int> SeqBoard::unresponsive(const std::vector<int>& world_ranks,
                                        std::chrono::milliseconds window,
                                        std::chrono::milliseconds timeout) {
  std::vector<int> peers;
  std::vector<std::string> keys;
  for (int r : world_ranks) {
    if (r == world_rank_) continue;
    peers.push_back(r);
    keys.push_back(fmt::format("pxc/alive/{}", r));
  }
  if (peers.empty()) return {};
  const auto before = read_keys(keys, timeout);
  std::this_thread::sleep_for(std::max(window, kHeartbeat * 4));
  const auto after = read_keys(keys, timeout);
  std::vector<int> out;
  for (std::size_t i = 0; i < peers.size(); ++i) {
    if (!after[i] || before[i] == after[i]) out.push_back(peers[i]);
  }
  return out;
}

void SeqBoard::run(const std::shared_ptr<Shared>& s) {
  // Wakes every kFlushInterval (or on flush()/stop) and writes the newest update of each group.
  std::unique_lock<std::mutex> lock(s->mu);
  auto next_beat = std::chrono::steady_clock::now();
  while (true) {
    s->cv.wait_for(lock, kFlushInterval, [&] { return s->stop || s->flush_requested; });
    s->flush_requested = false;
    if (!s->broken && !s->stop && std::chrono::steady_clock::now() >= next_beat) {
      next_beat = std::chrono::steady_clock::now() + kHeartbeat;
      s->pending[fmt::format("pxc/alive/{}", s->world_rank)] = Shared::Update{++s->beats, nullptr};
    }
    if (s->pending.empty() || s->broken) {
      if (s->stop) break;
      s->cv.notify_all();
      continue;
    }
    std::map<std::string, Shared::Update> batch;
    batch.swap(s->pending);
    s->writing = true;
    lock.unlock();
    bool ok = true;
    std::string err;
    try {
      for (auto& [k, u] : batch) {
        const std::string v = fmt::format("{}|{}", u.seq, u.summary ? u.summary() : std::string());
        s->writer->set(k, std::vector<uint8_t>(v.begin(), v.end()));
      }
    } catch (const c10::Error& e) {
      ok = false;
      err = e.what_without_backtrace();
    } catch (const std::exception& e) {
      ok = false;
      err = e.what();
    }
    lock.lock();
    s->writing = false;
    if (!ok && !s->broken) {
      s->broken = true;
      s->pending.clear();
      core::log::debug(
          "hang-report store unreachable, sequence numbers are no longer published: {}",
          err.substr(0, std::min<std::size_t>(err.find('\n'), 200)));
    }
    s->cv.notify_all();
    if (s->stop && s->pending.empty()) break;
  }
  s->exited = true;
  s->cv.notify_all();
}

}  // namespace parallax::comm::detail
