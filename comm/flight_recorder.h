// The flight recorder: a fixed-size ring buffer of the last ops a communicator issued, so that a
// hang or a failure can be explained after the fact (which op, which call site, which state).
//
// Every communicator owns one (CommOptions::flight_recorder_size entries). On a timeout or error
// the communicator writes every live recorder of the process to `parallax_flight_<rank>.json` in
// $PARALLAX_FLIGHT_DIR (or the working directory) and logs the failing one.
//
// Thread-safety: all members may be called concurrently (the NCCL watchdog completes entries
// while the training thread issues new ones).
#pragma once

#include "comm/communicator.h"

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace parallax::comm {

class FlightRecorder {
 public:
  explicit FlightRecorder(int capacity);

  // Stores `entry` (overwriting the oldest when full); returns its id for set_state().
  uint64_t record(FlightEntry entry);
  // Updates an entry's state and finish time; ignored if the entry was already overwritten.
  void set_state(uint64_t id, OpState state);
  std::vector<FlightEntry> snapshot() const;  // oldest first
  int capacity() const { return static_cast<int>(slots_.size()); }
  uint64_t total_recorded() const;

 private:
  mutable std::mutex mu_;
  std::vector<FlightEntry> slots_;
  uint64_t next_ = 0;  // id of the next entry; slot = id % capacity
};

// JSON of one entry / of a list of entries (an array).
std::string to_json(const FlightEntry& entry);
std::string to_json(const std::vector<FlightEntry>& entries);

// Seconds since the epoch (wall clock), the time base of FlightEntry.
double wall_seconds();

// The dump file's path for `rank`: parallax_flight_<rank>.json in $PARALLAX_FLIGHT_DIR when set,
// else in `report_dir` (the run directory, World::set_report_dir), else in the working directory.
std::string flight_dump_path(int rank, const std::string& report_dir = "");

// Writes `json` to flight_dump_path(rank, report_dir) atomically (temp file + rename). Returns the
// path, or "" if it could not be written (the failure is logged; a dump must never mask the
// original error).
std::string write_flight_dump(int rank, const std::string& json,
                              const std::string& report_dir = "");

}  // namespace parallax::comm
