// Internal: the state a World shares with its communicators (store, hang-report board, live
// communicators, progress of poll-driven ops). Not part of the public API; include world.h.
// The members are defined in world_context.cpp, broadcast_from_root in rendezvous.cpp.
#pragma once

#include "comm/seq_board.h"
#include "comm/world.h"

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

namespace parallax::comm::detail {

class CommBase;

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

}  // namespace parallax::comm::detail
