// Internal: the state a World shares with its communicators (store, hang-report board, live
// communicators, progress of poll-driven ops). Not part of the public API; include world.h.
#pragma once

#include "parallel/comm/world.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace parallax::parallel::comm::detail {

class CommBase;

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

// An op that advances only when polled (the CPU ring). Every wait of any CPU op in the process
// polls all of them, so two ranks waiting on different pending ops never deadlock.
class Progressable {
 public:
  virtual ~Progressable() = default;
  // Advances; returns true when finished. Must not throw (store errors for the owner's poll).
  virtual bool progress_noexcept() = 0;
};

class WorldContext {
 public:
  LaunchInfo launch;
  int rank = 0;
  int size = 1;
  bool mpi = false;        // MPI is initialised and usable
  bool mpi_owned = false;  // this World called MPI_Init (and so finalises)
  c10::intrusive_ptr<c10d::Store> store;
  std::unique_ptr<SeqBoard> board;
  std::optional<c10::Device> device;
  int cuda_devices = 0;
  double init_timeout_s = 300;
  int uncaught_at_start = 0;  // std::uncaught_exceptions() when the World was made
  std::atomic<bool> failed{false};
  std::atomic<bool> shut_down{false};

  void register_comm(CommBase* comm);
  void unregister_comm(CommBase* comm);
  // JSON document of every live communicator's flight recorder.
  std::string flight_json(const std::string& reason);
  // Frees every communicator's backend resources (World shutdown).
  void release_all();

  void add_progressable(const std::shared_ptr<Progressable>& p);
  void progress_all();

  // Keeps the buffers of an abandoned (timed-out) op alive until exit: a stuck backend may still
  // write into them.
  void bury(std::shared_ptr<void> keep_alive);

  // Where hang and failure reports go (the run directory; World::set_report_dir).
  void set_report_dir(std::string dir);
  std::string report_dir();

  // Per-process counter for world communicators of one backend, so their store keys differ.
  std::string next_world_uid(const std::string& backend);

  // `bytes` of world rank 0, delivered to every rank (MPI_Bcast, else the store under `key`).
  std::vector<uint8_t> broadcast_from_root(std::vector<uint8_t> bytes, const std::string& key,
                                           double timeout_s);

 private:
  std::mutex mu_;
  std::vector<CommBase*> comms_;
  std::vector<std::weak_ptr<Progressable>> progress_;
  std::vector<std::shared_ptr<void>> graveyard_;
  std::map<std::string, int> world_counts_;
  std::string report_dir_;
  std::mutex progress_mu_;
};

}  // namespace parallax::parallel::comm::detail
