// Internal: the commit protocol of one save (checkpointer.h, steps 1 to 4), run by every rank of
// the group: rank 0 creates and publishes the temporary directory, every rank writes its own file
// and publishes its shard index or its error, rank 0 gathers the indexes, writes metadata.json,
// renames the directory into place, moves `latest` and prunes, and publishes the result that the
// other ranks wait for. Every store call is bounded (bounded_store.h); a rank or a store that does
// not answer within `timeout_s` fails the save with a TimeoutError and marks the World failed.
//
// Contracts: one CommitProtocol per Checkpointer, constructed on every rank of the group in the
// same order (it claims the Checkpointer's key prefix in the store); run() is called with the same
// jobs in the same order on every rank, never concurrently (the Checkpointer's training thread or
// its one writer thread). Not movable: the store's on-lost callback refers to the group.
#pragma once

#include "checkpoint/bounded_store.h"
#include "checkpoint/checkpointer.h"
#include "checkpoint/shard_index.h"
#include "checkpoint/tensor_io.h"

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace parallax::checkpoint {

// One save: its step, its sequence number (the store key of this save), the entries this rank
// owns (live tensors for a sync save, host snapshots for an async one) and the metadata extras.
struct SaveJob {
  int64_t step = 0;
  int64_t seq = 0;
  std::vector<OwnedEntry> entries;
  std::map<std::string, ExtraValue> extra;
};

class CommitProtocol {
 public:
  // `opts` and `group` are validated by the caller. With world > 1, claims this Checkpointer's key
  // prefix in the group's store and opens the writer's own connection (TCPStore::clone); throws
  // TimeoutError / CommError when the store does not answer.
  CommitProtocol(std::string dir, CheckpointerOptions opts, CommitGroup group);
  CommitProtocol(const CommitProtocol&) = delete;
  CommitProtocol& operator=(const CommitProtocol&) = delete;

  // Runs one save to the end on this rank: returns once the checkpoint is committed, throws the
  // save's error otherwise (see checkpointer.h for the error types). blocking_s is left to the
  // caller.
  SaveStats run(const SaveJob& job);

  const std::string& dir() const { return dir_; }
  const CheckpointerOptions& options() const { return opts_; }
  const CommitGroup& group() const { return group_; }

 private:
  // Steps of run(), in order.
  std::string open_temp_dir(const SaveJob& job, Clock::time_point& published);
  RankIndex write_own_file(const SaveJob& job, const std::filesystem::path& tmp, SaveStats& st);
  void report_write_failure(const SaveJob& job, const std::filesystem::path& tmp,
                            const std::exception& e);
  std::string await_commit(const SaveJob& job, const RankIndex& mine);
  std::string commit_as_rank0(const SaveJob& job, const std::filesystem::path& tmp, RankIndex mine,
                              Clock::time_point published);

  void check_finite(const SaveJob& job) const;
  void gather(const SaveJob& job, std::vector<RankIndex>& indexes, Clock::time_point deadline);
  Metadata assemble_metadata(const SaveJob& job, std::vector<RankIndex> indexes) const;
  std::string commit(const SaveJob& job, const std::filesystem::path& tmp,
                     std::vector<RankIndex> indexes, Clock::time_point commit_by);
  void wait_writers_finished(const SaveJob& job);
  void publish_result(const SaveJob& job, const std::string& result);
  void peer_lost() const;

  // The store, keyed per save.
  std::string key(const SaveJob& job, const std::string& what) const;
  void store_set(const SaveJob& job, const std::string& k, const std::string& v,
                 const std::string& what);
  int64_t store_add(const SaveJob& job, const std::string& k, int64_t n, const std::string& what);
  std::string store_wait_get(const SaveJob& job, const std::string& k, const std::string& what);

  std::string dir_;
  CheckpointerOptions opts_;
  CommitGroup group_;
  BoundedStore store_;    // this Checkpointer's own connection (the writer's), every call bounded
  std::string instance_;  // store key prefix of this Checkpointer
  tensor_io::Staging staging_;  // device -> host buffer of sync saves' writes
};

}  // namespace parallax::checkpoint
