// Internal: the hang-report board. Every rank publishes, per communicator, the last collective it
// issued, and a heartbeat, to the out-of-band store; a rank whose op timed out reads its peers'
// entries to name the ranks that never arrived (CommBase::peer_report). Not part of the public
// API.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace parallax::comm::detail {

// Publishes, per communicator, the last collective this rank issued ("seq op site") under
// `pxc/seq/<uid>/<world rank>`, and reads the peers' values when an op times out. Publishing runs
// on a background thread over its own store connection (a clone), so a collective never waits on
// the store; updates are coalesced and written within ~kFlushInterval.
//
// Every wait is bounded: the store may live in a peer that is stopped (SIGSTOP) or dead, and
// c10d's TCPStore client calls (set, check, get) have no deadline of their own. read() runs its
// store calls on a helper thread and gives up after its deadline; the destructor waits at most
// kStopWait for the writer and then leaves it behind (its state is shared, not owned by `this`).
class SeqBoard {
 public:
  static constexpr std::chrono::milliseconds kFlushInterval{20};
  static constexpr std::chrono::milliseconds kStopWait{2000};
  // The writer also bumps a per-rank heartbeat counter (`pxc/alive/<world rank>`) this often, so a
  // failing rank can tell which peers stopped responding (stopped, killed, or wedged).
  static constexpr std::chrono::milliseconds kHeartbeat{250};

  SeqBoard(const c10::intrusive_ptr<c10d::Store>& store, int world_rank);
  ~SeqBoard();
  SeqBoard(const SeqBoard&) = delete;
  SeqBoard& operator=(const SeqBoard&) = delete;

  // Cheap (no syscall, no formatting): the writer thread formats `summary` for the newest entry of
  // each group only, when it flushes.
  void publish(const std::string& uid, uint64_t seq, std::function<std::string()> summary);
  // Writes synchronously (communicator creation, so that every member's key exists).
  void publish_now(const std::string& uid, uint64_t seq, const std::string& summary);
  // Waits until every pending update is written, the writer gave up, or `timeout` passed.
  void flush(std::chrono::milliseconds timeout = std::chrono::milliseconds(2000));

  struct PeerState {
    bool known = false;
    uint64_t seq = 0;
    std::string summary;
  };
  // Reads the members' published states within `timeout`. Throws TimeoutError if the store did not
  // answer in time (a stopped or dead store host), or the store's own error.
  std::map<int, PeerState> read(const std::string& uid, const std::vector<int>& world_ranks,
                                std::chrono::milliseconds timeout);
  // The ranks of `world_ranks` (other than this one) whose heartbeat did not advance over `window`
  // (at least 4 heartbeats), or that never published one. Bounded by window + 2 x `timeout`; throws
  // as read() does.
  std::vector<int> unresponsive(const std::vector<int>& world_ranks,
                                std::chrono::milliseconds window,
                                std::chrono::milliseconds timeout);

 private:
  struct Shared;  // what the writer thread and read()'s helper threads may outlive `this` with
  static void run(const std::shared_ptr<Shared>& s);
  static std::string key(const std::string& uid, int rank);
  // Reads `keys` on a helper thread within `timeout` (nullopt: key absent).
  std::vector<std::optional<std::string>> read_keys(const std::vector<std::string>& keys,
                                                    std::chrono::milliseconds timeout);

  std::shared_ptr<Shared> shared_;
  int world_rank_;
  std::thread thread_;
};

}  // namespace parallax::comm::detail
