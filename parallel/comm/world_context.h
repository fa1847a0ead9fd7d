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
#include <string>
#include <thread>
#include <vector>

namespace parallax::parallel::comm::detail {

class CommBase;

// Publishes, per communicator, the last collective this rank issued ("seq op site") under
// `pxc/seq/<uid>/<world rank>`, and reads the peers' values when an op times out. Publishing runs
// on a background thread over its own store connection (a clone), so a collective never waits on
// the store; updates are coalesced and written within ~kFlushInterval.
class SeqBoard {
 public:
  static constexpr std::chrono::milliseconds kFlushInterval{20};

  SeqBoard(const c10::intrusive_ptr<c10d::Store>& store, int world_rank);
  ~SeqBoard();
  SeqBoard(const SeqBoard&) = delete;
  SeqBoard& operator=(const SeqBoard&) = delete;

  // Cheap (no syscall, no formatting): the writer thread formats `summary` for the newest entry of
  // each group only, when it flushes.
  void publish(const std::string& uid, uint64_t seq, std::function<std::string()> summary);
  // Writes synchronously (communicator creation, so that every member's key exists).
  void publish_now(const std::string& uid, uint64_t seq, const std::string& summary);
  // Blocks until every pending update is written (or the writer gave up).
  void flush();

  struct PeerState {
    bool known = false;
    uint64_t seq = 0;
    std::string summary;
  };
  // Reads the members' published states; throws c10::Error / std::exception if the store fails.
  std::map<int, PeerState> read(const std::string& uid, const std::vector<int>& world_ranks);

 private:
  void run();
  static std::string key(const std::string& uid, int rank);

  c10::intrusive_ptr<c10d::Store> writer_;  // used by the thread only
  c10::intrusive_ptr<c10d::Store> reader_;  // used by callers of read()/publish_now()
  int world_rank_;
  std::mutex mu_;
  std::mutex reader_mu_;
  std::condition_variable cv_;
  struct Update {
    uint64_t seq = 0;
    std::function<std::string()> summary;
  };
  std::map<std::string, Update> pending_;  // key -> newest update
  bool stop_ = false;
  bool flush_requested_ = false;
  bool writing_ = false;
  bool broken_ = false;
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
  std::mutex progress_mu_;
};

}  // namespace parallax::parallel::comm::detail
