#include "checkpoint/commit.h"

#include "checkpoint/files.h"
#include "checkpoint/finite.h"
#include "checkpoint/prune.h"
#include "checkpoint/rank_file.h"
#include "comm/world.h"
#include "comm/world_context.h"
#include "core/config.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "core/timer.h"

#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <exception>
#include <thread>

namespace fs = std::filesystem;

namespace parallax::checkpoint {
namespace {

// A rank of the save did not arrive in time, or the store is gone: the World must not wait for
// its peers at exit (World::~World's barrier would wait out the init timeout for a stopped rank),
// so it is marked failed, as a timed-out collective marks it. Only when `store` is the World's.
void mark_world_failed(const c10::intrusive_ptr<c10d::Store>& store) {
  if (!comm::World::exists()) return;
  auto& w = comm::World::current();
  if (!store || w.store().get() != store.get()) return;
  w.context()->failed = true;
}

// What a store call of `job` does, for messages.
std::string doing(const SaveJob& job, const std::string& what) {
  return fmt::format("save of step {}: {}", job.step, what);
}

}  // namespace

CommitProtocol::CommitProtocol(std::string dir, CheckpointerOptions opts, CommitGroup group)
    : dir_(std::move(dir)), opts_(std::move(opts)), group_(std::move(group)) {
  if (group_.world <= 1) return;
  std::error_code ec;
  const std::string abs = fs::absolute(dir_, ec).lexically_normal().string();
  // Where the store lives, for messages: the World's store is rank 0's (MPI, torchrun) or a
  // launcher's (an agent store: torchrun's or `parallax launch`'s).
  std::string host = "the checkpoint store";
  if (comm::World::exists() && comm::World::current().store().get() == group_.store.get()) {
    host = comm::World::current().launch().agent_store ? "the launcher's store"
                                                       : "hosted by world rank 0";
  }
  auto on_lost = [store = group_.store] { mark_world_failed(store); };
  BoundedStore world_store(group_.store, group_.rank, host, opts_.timeout_s, on_lost);
  const int64_t n =
      world_store.add(fmt::format("pxckpt/instance/{}/{}", core::stable_hash(abs), group_.rank), 1,
                      fmt::format("the set-up of checkpoints in '{}'", dir_));
  instance_ = fmt::format("pxckpt/{}/{}", core::stable_hash(abs), n);
  // A TCPStore connection of its own for the writer; other stores (HashStore in tests) are
  // in-process and thread-safe, and their clone() may not share the data.
  c10::intrusive_ptr<c10d::Store> own = group_.store;
  if (dynamic_cast<c10d::TCPStore*>(group_.store.get()) != nullptr)
    own = world_store.clone(fmt::format("the set-up of checkpoints in '{}'", dir_));
  store_ = BoundedStore(own, group_.rank, host, opts_.timeout_s, on_lost);
}

void CommitProtocol::peer_lost() const {
  mark_world_failed(group_.store);
}

// ---- the store, keyed per save ----

std::string CommitProtocol::key(const SaveJob& job, const std::string& what) const {
  return fmt::format("{}/{}/{}", instance_, job.seq, what);
}

void CommitProtocol::store_set(const SaveJob& job, const std::string& k, const std::string& v,
                               const std::string& what) {
  store_.set(k, v, doing(job, what));
}

int64_t CommitProtocol::store_add(const SaveJob& job, const std::string& k, int64_t n,
                                  const std::string& what) {
  return store_.add(k, n, doing(job, what));
}

// Rank 0's word `k` (the temporary directory, the commit's result), within the timeout.
std::string CommitProtocol::store_wait_get(const SaveJob& job, const std::string& k,
                                           const std::string& what) {
  const auto start = Clock::now();
  try {
    store_.wait(k, opts_.timeout_s, doing(job, "waiting for " + what));
  } catch (const TimeoutError&) {
    throw;  // the store itself stopped answering: its message names its host
  } catch (const CommError& e) {
    peer_lost();
    // Before the timeout: the store failed (its host died), which its message says.
    if (Clock::now() - start < seconds(opts_.timeout_s * 0.9)) throw;
    throw_error<TimeoutError>(
        "rank {}: save of step {}: no word from rank 0 ({}) within {:.0f} s "
        "(parallel.checkpoint_timeout_s): world rank 0 did not arrive ({})",
        group_.rank, job.step, what, opts_.timeout_s, e.what());
  }
  return store_.get(k, doing(job, "reading " + what));
}

// ---- one save ----

SaveStats CommitProtocol::run(const SaveJob& job) {
  core::Stopwatch total;
  SaveStats st;
  st.step = job.step;
  st.entries = static_cast<int64_t>(job.entries.size());
  Clock::time_point published{};  // rank 0: when the temporary directory's name was published
  const fs::path tmp = fs::path(dir_) / open_temp_dir(job, published);
  RankIndex mine = write_own_file(job, tmp, st);
  if (group_.world > 1 && group_.rank != 0)
    st.path = await_commit(job, mine);
  else
    st.path = commit_as_rank0(job, tmp, std::move(mine), published);
  st.total_s = total.elapsed_s();
  return st;
}

// Step 1. Rank 0 clears leftovers, creates the temporary directory and publishes its name (or its
// failure); the other ranks wait for that name.
std::string CommitProtocol::open_temp_dir(const SaveJob& job, Clock::time_point& published) {
  const bool multi = group_.world > 1;
  if (group_.rank != 0) {
    const std::string tmp_name = store_wait_get(job, key(job, "dir"), "the temporary directory");
    if (!tmp_name.empty() && tmp_name[0] == '!') {
      throw_error<CheckpointError>("rank {}: save of step {} failed on rank 0: {}", group_.rank,
                                   job.step, tmp_name.substr(1));
    }
    return tmp_name;
  }
  std::string tmp_name;
  try {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec) throw_error<IoError>("cannot create checkpoint directory '{}': {}", dir_, ec.message());
    remove_leftovers(dir_);
    tmp_name = std::string(kTempPrefix) + step_dir_name(job.step) + "-" + files::random_hex(6);
    fs::create_directory(fs::path(dir_) / tmp_name, ec);
    if (ec)
      throw_error<IoError>("cannot create '{}': {}", (fs::path(dir_) / tmp_name).string(),
                           ec.message());
  } catch (const std::exception& e) {
    if (multi)
      store_set(job, key(job, "dir"), std::string("!") + e.what(), "publishing its failure");
    throw;
  }
  if (multi) store_set(job, key(job, "dir"), tmp_name, "publishing the temporary directory");
  // The other ranks start waiting for the commit (for timeout_s) only after they read the
  // directory's name, so a commit by published + timeout_s is one they still wait for. Anchored
  // here, not when rank 0 starts gathering: a rank 0 stopped while writing its own file would
  // otherwise start a fresh deadline when it resumes and commit after the others gave up. (Rank
  // 0's own file must then be written within timeout_s, 1800 s by default.)
  published = Clock::now();
  return tmp_name;
}

// Step 2. This rank's file, after the finiteness check; a failure is reported to the others.
RankIndex CommitProtocol::write_own_file(const SaveJob& job, const fs::path& tmp, SaveStats& st) {
  const std::string file = (tmp / rank_file_name(group_.rank)).string();
  try {
    check_finite(job);
    core::Stopwatch w;
    // A background writer checksums on its own thread only: training owns the other cores.
    RankIndex mine = write_rank_file(file, group_.rank, job.entries, opts_.block_bytes, staging_,
                                     st.bytes, !opts_.async);
    st.write_s = w.elapsed_s();
    return mine;
  } catch (const std::exception& e) {
    report_write_failure(job, tmp, e);
    throw;
  }
}

// Publishes this rank's failure to write its file. Rank 0 aborts the save; another rank throws
// rank 0's error instead of its own when rank 0 failed first (its error is the cause).
void CommitProtocol::report_write_failure(const SaveJob& job, const fs::path& tmp,
                                          const std::exception& e) {
  const int rank = group_.rank;
  const bool multi = group_.world > 1;
  if (multi) {
    try {
      store_set(job, key(job, fmt::format("error/{}", rank)), e.what(),
                "publishing this rank's failure");
      // Rank 0 does not count itself: nfail counts the writers rank 0 waits for (see
      // wait_writers_finished), and counting rank 0's own failure there let it remove the
      // temporary directory while another rank was still writing into it.
      if (rank != 0) store_add(job, key(job, "nfail"), 1, "counting this rank's failure");
    } catch (const std::exception&) {
    }
  }
  if (rank == 0) {
    // The result first: a rank whose writes fail once the directory is gone finds it. The
    // directory goes once every rank stopped writing into it (or the deadline passed): a rank
    // still creating its file while remove_all walks the directory would leave it behind.
    if (multi) {
      publish_result(job, std::string("error: ") + e.what());
      wait_writers_finished(job);
    }
    std::error_code ec;
    fs::remove_all(tmp, ec);
  } else if (multi) {
    // Rank 0 may have failed first (e.g. refused non-finite state) and removed the temporary
    // directory under this rank's writes: report its error, the cause, rather than ours.
    std::string result;
    try {
      if (store_.check(key(job, "result"), doing(job, "looking for rank 0's result")))
        result = store_.get(key(job, "result"), doing(job, "reading rank 0's result"));
    } catch (const std::exception&) {
    }
    if (core::starts_with(result, "error: ")) {
      throw_error<CheckpointError>("rank {}: save of step {} was not committed: {}", rank, job.step,
                                   result.substr(7));
    }
  }
}

// Steps 2 and 4 of a rank other than 0: publish the index, wait for rank 0's result.
std::string CommitProtocol::await_commit(const SaveJob& job, const RankIndex& mine) {
  store_set(job, key(job, fmt::format("index/{}", group_.rank)), mine.serialize(),
            "publishing this rank's shard index");
  store_add(job, key(job, "ndone"), 1, "counting this rank's file as written");
  const std::string result = store_wait_get(job, key(job, "result"), "the commit");
  store_add(job, key(job, "nack"), 1, "acknowledging the commit");
  if (result.rfind("ok ", 0) != 0) {
    throw_error<CheckpointError>("rank {}: save of step {} was not committed: {}", group_.rank,
                                 job.step, result.substr(std::min<size_t>(result.size(), 7)));
  }
  return result.substr(3);
}

// Step 3: rank 0 gathers, commits and publishes; on any failure it publishes the error and
// removes the temporary directory once the other ranks stopped writing into it.
std::string CommitProtocol::commit_as_rank0(const SaveJob& job, const fs::path& tmp, RankIndex mine,
                                            Clock::time_point published) {
  const bool multi = group_.world > 1;
  std::string path;
  try {
    std::vector<RankIndex> indexes{std::move(mine)};
    // The other ranks wait for the commit for at least timeout_s from `published`: past that,
    // no commit.
    const auto commit_by = multi ? published + seconds(opts_.timeout_s) : Clock::time_point::max();
    if (multi) gather(job, indexes, commit_by);
    path = commit(job, tmp, std::move(indexes), commit_by);
  } catch (const std::exception& e) {
    if (multi) {
      publish_result(job, std::string("error: ") + e.what());
      wait_writers_finished(job);
    }
    std::error_code ec;
    fs::remove_all(tmp, ec);
    throw;
  }
  if (multi) publish_result(job, "ok " + path);
  return path;
}

// Refuses the save when a tensor this rank writes holds NaN or infinity (see checkpointer.h).
// Sync saves check the live tensors (GPU ones on their device), async saves their snapshot, on
// the writer thread and without ATen's intra-op threads.
void CommitProtocol::check_finite(const SaveJob& job) const {
  if (opts_.allow_nonfinite) return;
  std::vector<at::Tensor> tensors;
  tensors.reserve(job.entries.size());
  for (const OwnedEntry& e : job.entries) tensors.push_back(e.tensor);
  const int64_t bad = first_nonfinite(tensors, /*parallel=*/!opts_.async);
  if (bad < 0) return;
  const OwnedEntry& e = job.entries[static_cast<size_t>(bad)];
  const NonFiniteCount c = count_nonfinite(e.tensor);
  throw_error<CheckpointError>(
      "rank {}: save of step {} refused: tensor '{}' holds {} NaN and {} infinite value(s) of "
      "{}; a checkpoint never commits non-finite parameters or optimizer state, so the "
      "previous checkpoints are kept (the run diverged: lower optim.lr or check the data)",
      group_.rank, job.step, e.name, c.nan, c.inf, e.tensor.numel());
}

// Waits until `deadline` for the other ranks' shard indexes. Past the deadline it never accepts
// them, even when they are all there: the other ranks wait for the commit from about when this
// wait began, so they may have given up (and reported the save as failed) already (rank 0 held
// up, e.g. stopped, while they waited).
void CommitProtocol::gather(const SaveJob& job, std::vector<RankIndex>& indexes,
                            Clock::time_point deadline) {
  auto sleep = std::chrono::milliseconds(1);
  for (;;) {
    const int64_t failed = store_add(job, key(job, "nfail"), 0, "counting the failed ranks");
    if (failed > 0) {
      std::vector<std::string> errs;
      for (int r = 1; r < group_.world; ++r) {
        const std::string k = key(job, fmt::format("error/{}", r));
        if (store_.check(k, doing(job, "looking for the errors")))
          errs.push_back(store_.get(k, doing(job, "reading the errors")));
      }
      throw_error<CheckpointError>("save of step {} failed on {} rank(s): {}", job.step, failed,
                                   core::join(errs, " | "));
    }
    const bool all =
        store_add(job, key(job, "ndone"), 0, "counting the written files") >= group_.world - 1;
    if (Clock::now() > deadline) {
      std::vector<int> missing;
      for (int r = 1; r < group_.world; ++r) {
        if (!store_.check(key(job, fmt::format("index/{}", r)),
                          doing(job, "looking for the missing ranks")))
          missing.push_back(r);
      }
      peer_lost();
      if (missing.empty()) {
        throw_error<TimeoutError>(
            "save of step {}: not committed: rank 0 was held up (stopped or starved) for more "
            "than {:.0f} s (parallel.checkpoint_timeout_s) while the other ranks waited for the "
            "commit, so they may have given up; the last committed checkpoint stays latest",
            job.step, opts_.timeout_s);
      }
      throw_error<TimeoutError>(
          "save of step {}: rank(s) {} did not arrive: no shard file within {:.0f} s "
          "(parallel.checkpoint_timeout_s); the last committed checkpoint stays latest",
          job.step, missing, opts_.timeout_s);
    }
    if (all) break;
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::milliseconds(50));
  }
  for (int r = 1; r < group_.world; ++r) {
    const std::string k = key(job, fmt::format("index/{}", r));
    indexes.push_back(RankIndex::parse(store_.get(k, doing(job, "reading a shard index")), r));
    store_.remove(k, doing(job, "removing a shard index"));
  }
}

// The checkpoint's metadata from every rank's index: one TensorInfo per name, its pieces in the
// order of their first elements; throws CheckpointError when ranks disagree on a tensor's dtype
// or shape, or when its pieces do not tile it.
Metadata CommitProtocol::assemble_metadata(const SaveJob& job,
                                           std::vector<RankIndex> indexes) const {
  Metadata m;
  m.step = job.step;
  m.layout = opts_.layout;
  m.world = group_.world;
  m.config_hash = opts_.config_hash;
  m.created = files::utc_now_iso8601();
  m.extra = job.extra;
  std::map<std::string, int> first_rank;
  std::sort(indexes.begin(), indexes.end(),
            [](const RankIndex& a, const RankIndex& b) { return a.rank < b.rank; });
  for (const RankIndex& idx : indexes) {
    m.files.push_back(FileInfo{idx.file, idx.rank, idx.bytes});
    for (const ShardRecord& s : idx.shards) {
      auto [it, fresh] = m.tensors.try_emplace(s.name);
      TensorInfo& t = it->second;
      if (fresh) {
        t.name = s.name;
        t.dtype = s.dtype;
        t.shape = s.shape;
        first_rank[s.name] = idx.rank;
      } else if (t.dtype != s.dtype || t.shape != s.shape) {
        throw_error<CheckpointError>(
            "save of step {}: tensor '{}' is {} {} on rank {} but {} {} on rank {} (every rank "
            "holding a piece must "
            "agree on dtype and global shape)",
            job.step, s.name, dtype_name(t.dtype), t.shape, first_rank[s.name], dtype_name(s.dtype),
            s.shape, idx.rank);
      }
      t.shards.push_back(ShardInfo{idx.file, s.offsets, s.lengths, s.crc32, s.flat, s.piece});
    }
  }
  m.format_version = m.version_needed();
  for (auto& [name, t] : m.tensors) {
    // In the order of their first elements (C order), whatever ranks wrote them.
    auto first = [&t](const ShardInfo& s) {
      if (s.flat) return s.flat->begin;
      int64_t lin = 0;
      for (size_t d = 0; d < t.shape.size(); ++d) lin = lin * t.shape[d] + s.offsets[d];
      return lin;
    };
    std::stable_sort(t.shards.begin(), t.shards.end(),
                     [&](const ShardInfo& a, const ShardInfo& b) { return first(a) < first(b); });
    if (const std::string problem = tiling_problem(t); !problem.empty()) {
      throw_error<CheckpointError>(
          "save of step {}: the pieces of tensor '{}' (shape {}) {}; the ranks holding it "
          "disagree about its replicas, boxes or flat ranges",
          job.step, name, t.shape, problem);
    }
  }
  return m;
}

// The durable part of step 3: config.yaml and metadata.json, the directory renamed into place,
// `latest` moved, old checkpoints pruned. Returns the committed directory.
std::string CommitProtocol::commit(const SaveJob& job, const fs::path& tmp,
                                   std::vector<RankIndex> indexes, Clock::time_point commit_by) {
  std::optional<SideFile> config;
  if (!opts_.config_text.empty()) {
    files::write_durable((tmp / kConfigFile).string(), opts_.config_text);
    config =
        SideFile{kConfigFile, static_cast<int64_t>(opts_.config_text.size()),
                 tensor_io::crc32_update(0, opts_.config_text.data(),
                                         static_cast<int64_t>(opts_.config_text.size()), false)};
  }
  Metadata m = assemble_metadata(job, std::move(indexes));
  m.config = config;
  files::write_durable((tmp / kMetadataFile).string(), m.to_json());
  files::fsync_path(tmp.string(), true);
  // Rank 0 held up past the deadline (stopped, starved): the other ranks may have reported the
  // save as failed, so it must not become `latest` (checked again right before `latest` moves).
  const auto check_deadline = [&] {
    if (Clock::now() <= commit_by) return;
    peer_lost();
    throw_error<TimeoutError>(
        "save of step {}: not committed: rank 0 was held up (stopped or starved) past the "
        "deadline of the other ranks ({:.0f} s, parallel.checkpoint_timeout_s); the last "
        "committed checkpoint stays latest",
        job.step, opts_.timeout_s);
  };
  check_deadline();
  const fs::path final_dir = fs::path(dir_) / step_dir_name(job.step);
  const bool replaced = files::move_into_place(tmp.string(), final_dir.string());
  files::fsync_path(dir_, true);
  files::write_atomic((fs::path(dir_) / kLatestFile).string(), step_dir_name(job.step) + "\n",
                      check_deadline);
  if (replaced) {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // the replaced checkpoint of the same step
  }
  prune_checkpoints(dir_, job.step, opts_.keep_last);
  return final_dir.string();
}

// Waits until every other rank finished (index written) or failed its write, or the checkpoint
// deadline passes (a dead rank never reports); never throws.
void CommitProtocol::wait_writers_finished(const SaveJob& job) {
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(opts_.timeout_s * 1000));
  auto sleep = std::chrono::milliseconds(1);
  try {
    while (store_add(job, key(job, "ndone"), 0, "counting the written files") +
                   store_add(job, key(job, "nfail"), 0, "counting the failed ranks") <
               group_.world - 1 &&
           Clock::now() < deadline) {
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::milliseconds(50));
    }
    if (Clock::now() >= deadline) peer_lost();  // a rank never reported: do not wait at exit
  } catch (const std::exception& e) {
    core::log::warn("checkpoint: waiting for the other ranks of step {}: {}", job.step, e.what());
  }
}

void CommitProtocol::publish_result(const SaveJob& job, const std::string& result) {
  try {
    store_set(job, key(job, "result"), result, "publishing the result");
  } catch (const std::exception& e) {
    core::log::warn("checkpoint: cannot publish the result of step {}: {}", job.step, e.what());
  }
}

}  // namespace parallax::checkpoint
