// Saving sharded checkpoints: every rank writes the entries it owns into its own HDF5 file, in
// parallel; rank 0 commits the checkpoint atomically once every rank's file is durable.
//
// Commit protocol (one save; the same machinery for synchronous and asynchronous saves):
//   1. rank 0 removes leftovers of killed saves (`.tmp-*`), creates `.tmp-step_XXXXXXXX-<hex>/` and
//      publishes its name in the World's TCPStore;
//   2. every rank checks that the floating tensors it owns are finite (finite.h), then writes
//      `rank_XXXXX.h5` there (tensor by tensor, in blocks of at most `block_bytes`), fsyncs it and
//      publishes its shard index (names, boxes, crc32) in the store;
//   3. rank 0 waits (up to `timeout_s`) for every index, writes config.yaml and metadata.json,
//      fsyncs the directory, renames it to `step_XXXXXXXX/`, fsyncs the parent, atomically replaces
//      `latest` (temp file + fsync + rename + directory fsync), prunes to `keep_last` and publishes
//      "ok". Past that deadline (rank 0 held up: stopped, starved) it commits nothing, not even
//      with every index there: the others may have given up on it;
//   4. the other ranks wait (up to `timeout_s`) for that result. A rank that fails publishes its
//      error instead; rank 0 then aborts the save (removing the temporary directory once every
//      other rank stopped writing into it, or the deadline passed) and every rank reports the
//      error.
// Every store call has a deadline (`timeout_s`): c10d's TCPStore client calls have none, and the
// store lives in rank 0's process (or a launcher's), which may be stopped. A call runs on a helper
// thread that is given up at the deadline (left behind, detached); the save then fails with a
// TimeoutError naming the store's host ("world rank 0 did not arrive"), later calls fail at once,
// and the World is marked failed (as by a timed-out collective) so that its shutdown does not wait
// for the missing rank.
// Non-finite state is such a failure: a rank whose owned tensors hold a NaN or an infinity refuses
// the save (CheckpointError naming the step, the tensor and the rank), so no rank commits it, the
// previous checkpoints stay as they were and nothing is pruned. Every committed checkpoint is
// therefore finite, and `keep_last` never removes the newest finite one. Async saves check their
// snapshot, in the background thread, before the commit.
// A kill at any moment leaves `latest` pointing at a complete checkpoint: the previous one until
// step 3's rename of `latest`, the new one after. No collective of any communicator is used: the
// coordination is out of band (the store), so a background save never interleaves with training
// collectives.
//
// Async mode: save() snapshots the tensors this rank owns into host memory (reused between saves;
// pinned for CUDA sources) and returns; a background thread writes and commits. The next save()
// first waits for the previous one. Errors of a background save are rethrown by the next poll(),
// wait() or save() on the training thread, never dropped. Sync mode streams straight from the
// tensors (GPU tensors through one bounded staging buffer), so host memory stays bounded by
// `block_bytes`; async mode holds one snapshot of this rank's owned entries.
//
// Contracts: every rank of the group constructs its Checkpointers for one directory in the same
// order and calls save() with the same steps in the same order (like a collective). One job per
// checkpoints directory. Destroy Checkpointers before the World. Not thread-safe: call from the
// training thread. Errors: CheckpointError (bad entries, inconsistent shards, non-finite tensors),
// IoError (filesystem:
// cannot create, write, rename; disk full), TimeoutError (a rank or the store did not answer
// within timeout_s), CommError (the store failed, e.g. its host died); messages are one line.
#pragma once

#include "checkpoint/save_state.h"
#include "comm/topology.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace parallax::checkpoint {

struct CheckpointerOptions {
  int keep_last = 3;        // committed checkpoints kept, the new one included; 0 keeps all
  bool async = false;       // snapshot to host memory and write in a background thread
  double timeout_s = 1800;  // how long ranks wait for each other (parallel.checkpoint_timeout_s)
  std::string config_hash;  // core::stable_hash of the resolved config text
  comm::RankLayout layout;  // dp x tp x pp; the default (1, 1, 1) means dp = world
  int64_t block_bytes = 64 << 20;  // largest single transfer (device staging, HDF5 write)
  std::string config_text;  // the resolved config, saved as config.yaml in each checkpoint ("": no)
  bool allow_nonfinite = false;  // commit NaN / inf tensors (only to test readers of such files)
};

// Who takes part in saves: this rank, the world size and the out-of-band store that coordinates
// commits (required when world > 1).
struct CommitGroup {
  int rank = 0;
  int world = 1;
  c10::intrusive_ptr<c10d::Store> store;
  // World::current() when a World exists, else a single process without a store.
  static CommitGroup from_world();
};

struct SaveStats {
  int64_t step = -1;
  std::string path;       // the committed checkpoint directory
  int64_t bytes = 0;      // tensor bytes this rank wrote
  int64_t entries = 0;    // entries this rank wrote (owned)
  double blocking_s = 0;  // time save() held the caller (async: the snapshot)
  double write_s = 0;     // this rank's file: create, write, fsync
  double total_s = 0;     // save() until this rank saw the commit
};

class Checkpointer {
 public:
  // `checkpoints_dir`: runs/<name>/checkpoints (created on first save). Throws LayoutError when
  // options.layout does not match the group's world, CheckpointError when world > 1 without a
  // store.
  Checkpointer(std::string checkpoints_dir, CheckpointerOptions options,
               CommitGroup group = CommitGroup::from_world());
  // Waits for a save in flight (it commits); logs, never throws, its error.
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Saves `state` as step `step` (every rank, same steps, same order). Sync: returns once the
  // checkpoint is committed (on every rank). Async: returns after the snapshot. Waits for (and
  // rethrows the error of) the previous save first.
  void save(int64_t step, const SaveState& state);
  // Non-blocking: rethrows (once) the error of a background save that finished. Call every step.
  void poll();
  // Blocks until the save in flight is committed; rethrows its error.
  void wait();
  bool busy() const;
  // Stats of the last save that committed, if any.
  std::optional<SaveStats> last_save() const;
  const std::string& dir() const;
  const CheckpointerOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace parallax::checkpoint
