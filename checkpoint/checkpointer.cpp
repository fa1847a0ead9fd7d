#include "checkpoint/checkpointer.h"

#include "checkpoint/files.h"
#include "checkpoint/finite.h"
#include "checkpoint/h5.h"
#include "checkpoint/tensor_io.h"
#include "core/config.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "core/timer.h"
#include "parallel/comm/deadline_call.h"
#include "parallel/comm/world.h"
#include "parallel/comm/world_context.h"

#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <atomic>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;

namespace parallax::checkpoint {
namespace {

// ---- one rank's file
// ------------------------------------------------------------------------------

struct ShardRecord {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape, offsets, lengths;  // a box's offsets and lengths
  uint32_t crc32 = 0;
  std::optional<FlatRange> flat;  // or a flat range (offsets, lengths empty)
  int piece = 0;                  // this file's k-th piece of the tensor (format.h)
};

struct RankIndex {
  int rank = 0;
  std::string file;
  int64_t bytes = 0;
  std::vector<ShardRecord> shards;

  // A line format (the name last, so it may hold spaces): cheap to parse for thousands of shards.
  //   shard <crc32> <piece> <dtype> <ndim> <shape...> <offsets...> <lengths...> <name>   a box
  //   flat <crc32> <piece> <dtype> <ndim> <shape...> <begin> <end> <name>               a flat
  //   range
  std::string serialize() const {
    std::string out = fmt::format("parallax-shard-index 3\nfile {} {} {}\n", file, rank, bytes);
    for (const auto& s : shards) {
      out += fmt::format("{} {} {} {} {}", s.flat ? "flat" : "shard", s.crc32, s.piece,
                         dtype_name(s.dtype), s.shape.size());
      for (const int64_t x : s.shape) out += fmt::format(" {}", x);
      if (s.flat) {
        out += fmt::format(" {} {}", s.flat->begin, s.flat->end);
      } else {
        for (const auto* v : {&s.offsets, &s.lengths}) {
          for (const int64_t x : *v) out += fmt::format(" {}", x);
        }
      }
      out += " " + s.name + "\n";
    }
    return out;
  }

  static RankIndex parse(const std::string& text, int from_rank) {
    auto bad = [&](const std::string& what) -> void {
      throw_error<CheckpointError>("malformed shard index from rank {}: {}", from_rank, what);
    };
    std::istringstream in(text);
    std::string line;
    RankIndex idx;
    if (!std::getline(in, line) || line != "parallax-shard-index 3")
      bad("bad header '" + line + "'");
    if (!std::getline(in, line)) bad("no file line");
    {
      std::istringstream ls(line);
      std::string tag;
      ls >> tag >> idx.file >> idx.rank >> idx.bytes;
      if (tag != "file" || ls.fail()) bad("bad file line '" + line + "'");
    }
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      std::istringstream ls(line);
      std::string tag, dtype;
      ShardRecord s;
      size_t nd = 0;
      ls >> tag >> s.crc32 >> s.piece >> dtype >> nd;
      if ((tag != "shard" && tag != "flat") || ls.fail() || nd > 64 || s.piece < 0)
        bad("bad shard line '" + line + "'");
      s.dtype = dtype_from_name(dtype, fmt::format("shard index of rank {}", from_rank));
      s.shape.resize(nd);
      for (auto& x : s.shape) ls >> x;
      if (tag == "flat") {
        FlatRange f;
        ls >> f.begin >> f.end;
        s.flat = f;
      } else {
        for (auto* v : {&s.offsets, &s.lengths}) {
          v->resize(nd);
          for (auto& x : *v) ls >> x;
        }
      }
      if (ls.fail()) bad("bad shard line '" + line + "'");
      ls.get();  // the space before the name
      std::getline(ls, s.name);
      if (s.name.empty()) bad("a shard without a name");
      idx.shards.push_back(std::move(s));
    }
    return idx;
  }
};

RankIndex write_rank_file(const std::string& path, int rank, const std::vector<OwnedEntry>& entries,
                          int64_t block_bytes, tensor_io::Staging& staging, int64_t& data_bytes,
                          bool parallel_crc) {
  h5::quiet_errors();
  RankIndex idx;
  idx.rank = rank;
  idx.file = fs::path(path).filename().string();
  data_bytes = 0;
  {
    h5::Id fapl(H5Pcreate(H5P_FILE_ACCESS));
    if (!fapl.valid() || H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG) < 0)
      h5::fail<IoError>("file properties");
    h5::Id file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl));
    if (!file.valid())
      h5::fail<IoError>(fmt::format("rank {}: cannot create shard file '{}'", rank, path));
    h5::write_string_attr(file, "format", "parallax-checkpoint-shard");
    h5::write_int64_attr(file, "rank", rank);
    for (const OwnedEntry& e : entries) {
      const at::Tensor& src = e.tensor;
      const std::string dataset = piece_dataset(e.name, e.piece);
      const std::string ctx =
          fmt::format("rank {}: writing tensor '{}' to '{}'", rank, dataset, path);
      const uint32_t crc =
          tensor_io::write_dataset(file, dataset, src, block_bytes, staging, ctx, parallel_crc);
      if (src.dim() > 0) {
        h5::Id dset(H5Dopen2(file, dataset.c_str(), H5P_DEFAULT));
        if (!dset.valid()) h5::fail<IoError>(ctx);
        if (e.flat) {
          h5::write_int64s_attr(dset, "flat", {e.flat->begin, e.flat->end});
        } else {
          h5::write_int64s_attr(dset, "offsets", e.offsets);
        }
        h5::write_int64s_attr(dset, "global_shape", e.global_shape);
      }
      data_bytes += static_cast<int64_t>(src.nbytes());
      ShardRecord rec{e.name, src.scalar_type(), e.global_shape, {}, {}, crc, e.flat, e.piece};
      if (!e.flat) {
        rec.offsets = e.offsets;
        rec.lengths = src.sizes().vec();
      }
      idx.shards.push_back(std::move(rec));
    }
    // Close explicitly: buffered metadata is written here, and a full disk can surface here.
    if (H5Fclose(file.release()) < 0) {
      h5::fail<IoError>(
          fmt::format("rank {}: cannot write shard file '{}' (closing it failed)", rank, path));
    }
  }
  files::fsync_path(path, false);
  idx.bytes = files::file_size(path);
  return idx;
}

// ---- store helpers
// -----------------------------------------------------------------------------------

std::string to_string(const std::vector<uint8_t>& v) {
  return std::string(v.begin(), v.end());
}
std::vector<uint8_t> to_bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

using Clock = std::chrono::steady_clock;

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// The out-of-band store of a save, every call with a deadline. c10d's TCPStore client calls have
// none of their own: a store whose host is stopped (SIGSTOP, a hung node) keeps a call waiting
// forever. So each call runs on a helper thread that owns copies of what it uses, and is given up
// after its deadline (the helper is left behind, detached). The first call that times out or
// fails marks the store lost: later calls fail at once instead of each waiting out a deadline
// (and never share the connection with the abandoned helper), and `on_lost` runs once.
class BoundedStore {
 public:
  BoundedStore() = default;
  BoundedStore(c10::intrusive_ptr<c10d::Store> store, int rank, std::string host, double timeout_s,
               std::function<void()> on_lost)
      : store_(std::move(store)),
        rank_(rank),
        host_(std::move(host)),
        timeout_s_(timeout_s),
        on_lost_(std::move(on_lost)) {}

  void set(const std::string& k, const std::string& v, const std::string& what) {
    run(what, timeout_s_, [s = store_, k, v = to_bytes(v)] {
      s->set(k, v);
      return 0;
    });
  }
  std::string get(const std::string& k, const std::string& what) {
    return run(what, timeout_s_, [s = store_, k] { return to_string(s->get(k)); });
  }
  int64_t add(const std::string& k, int64_t n, const std::string& what) {
    return run(what, timeout_s_, [s = store_, k, n] { return s->add(k, n); });
  }
  bool check(const std::string& k, const std::string& what) {
    return run(what, timeout_s_, [s = store_, k] { return s->check({k}); });
  }
  void remove(const std::string& k, const std::string& what) {
    run(what, timeout_s_, [s = store_, k] { return s->deleteKey(k); });
  }
  // Waits up to `timeout_s` for `k` to exist. A store that answers "not yet" at the timeout throws
  // a CommError carrying its text; one that does not answer at all, a TimeoutError (see run()).
  void wait(const std::string& k, double timeout_s, const std::string& what) {
    const auto t = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    // The store's own timeout first; ours only catches a store that stopped answering.
    run(what, timeout_s + std::min(10.0, 1.0 + timeout_s / 10), [s = store_, k, t] {
      s->wait({k}, t);
      return 0;
    });
  }
  c10::intrusive_ptr<c10d::Store> clone(const std::string& what) {
    return run(what, timeout_s_, [s = store_] { return s->clone(); });
  }

 private:
  template <class F>
  auto run(const std::string& what, double deadline_s, F f) -> decltype(f()) {
    using R = decltype(f());
    if (lost_) {
      throw_error<CommError>(
          "rank {}: the checkpoint store ({}) is unusable since an earlier "
          "call: {} (during {})",
          rank_, host_, *lost_, what);
    }
    std::optional<R> r;
    try {
      r = parallel::comm::call_with_deadline(std::move(f), Clock::now() + seconds(deadline_s));
    } catch (const std::exception& e) {
      const std::string text = parallel::comm::one_line_what(e);
      lose(text);
      throw_error<CommError>("rank {}: the checkpoint store ({}) failed during {}: {}", rank_,
                             host_, what, text);
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

  // Who did not arrive when the store does not answer: the rank whose process hosts it, if any.
  std::string absent_host() const {
    const std::string tag = "hosted by ";
    if (core::starts_with(host_, tag))
      return host_.substr(tag.size()) + " did not arrive (stopped, hung or dead)";
    return "its host is stopped, hung or dead";
  }

  void lose(const std::string& why) {
    if (lost_) return;
    lost_ = why;
    if (on_lost_) on_lost_();
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_ = 0;
  std::string host_;
  double timeout_s_ = 1800;
  std::function<void()> on_lost_;
  std::optional<std::string> lost_;
};

}  // namespace

CommitGroup CommitGroup::from_world() {
  CommitGroup g;
  if (!parallel::comm::World::exists()) return g;
  auto& w = parallel::comm::World::current();
  g.rank = w.rank();
  g.world = w.size();
  g.store = w.store();
  return g;
}

struct Checkpointer::Impl {
  std::string dir;
  CheckpointerOptions opts;
  CommitGroup group;
  BoundedStore store;    // this Checkpointer's own connection (the writer's), every call bounded
  std::string instance;  // store key prefix of this Checkpointer
  int64_t seq = 0;

  std::thread worker;
  bool running = false;
  std::atomic<bool> done{false};
  std::exception_ptr error;
  std::optional<SaveStats> last;
  SaveStats pending;

  // async: host buffers reused between saves, by dataset path (one per piece of a tensor).
  std::map<std::string, at::Tensor> snapshots;
  tensor_io::Staging staging;

  struct Job {
    int64_t step = 0;
    int64_t seq = 0;
    std::vector<OwnedEntry> entries;
    std::map<std::string, ExtraValue> extra;
  };

  // ---- store ----
  std::string key(const Job& job, const std::string& what) const {
    return fmt::format("{}/{}/{}", instance, job.seq, what);
  }
  // What a store call of `job` does, for messages.
  static std::string doing(const Job& job, const std::string& what) {
    return fmt::format("save of step {}: {}", job.step, what);
  }
  void store_set(const Job& job, const std::string& k, const std::string& v,
                 const std::string& what) {
    store.set(k, v, doing(job, what));
  }
  int64_t store_add(const Job& job, const std::string& k, int64_t n, const std::string& what) {
    return store.add(k, n, doing(job, what));
  }
  // Rank 0's word `k` (the temporary directory, the commit's result), within the timeout.
  std::string store_wait_get(const Job& job, const std::string& k, const std::string& what) {
    const auto start = Clock::now();
    try {
      store.wait(k, opts.timeout_s, doing(job, "waiting for " + what));
    } catch (const TimeoutError&) {
      throw;  // the store itself stopped answering: its message names its host
    } catch (const CommError& e) {
      peer_lost();
      // Before the timeout: the store failed (its host died), which its message says.
      if (Clock::now() - start < seconds(opts.timeout_s * 0.9)) throw;
      throw_error<TimeoutError>(
          "rank {}: save of step {}: no word from rank 0 ({}) within {:.0f} s "
          "(parallel.checkpoint_timeout_s): world rank 0 did not arrive ({})",
          group.rank, job.step, what, opts.timeout_s, e.what());
    }
    return store.get(k, doing(job, "reading " + what));
  }

  // A rank of the save did not arrive in time, or the store is gone: the World must not wait for
  // its peers at exit (World::~World's barrier would wait out the init timeout for a stopped
  // rank), so it is marked failed, as a timed-out collective marks it.
  void peer_lost() const {
    if (!parallel::comm::World::exists()) return;
    auto& w = parallel::comm::World::current();
    if (!group.store || w.store().get() != group.store.get()) return;
    w.context()->failed = true;
  }

  // ---- directory maintenance (rank 0) ----
  void remove_leftovers() {
    std::error_code ec;
    for (const auto& de : fs::directory_iterator(dir, ec)) {
      const std::string n = de.path().filename().string();
      if (core::starts_with(n, kTempPrefix) ||
          core::starts_with(n, std::string(kLatestFile) + ".tmp-")) {
        std::error_code rm;
        fs::remove_all(de.path(), rm);
        if (rm)
          core::log::warn("checkpoint: cannot remove leftover '{}': {}", de.path().string(),
                          rm.message());
        else
          core::log::info("checkpoint: removed leftover '{}' of an interrupted save",
                          de.path().string());
      }
    }
  }

  void prune(int64_t step) {
    if (opts.keep_last <= 0) return;
    std::vector<std::pair<int64_t, std::string>> older;
    std::error_code ec;
    for (const auto& de : fs::directory_iterator(dir, ec)) {
      const std::string n = de.path().filename().string();
      if (auto s = parse_step_dir_name(n); s && *s < step && de.is_directory())
        older.emplace_back(*s, n);
    }
    std::sort(older.rbegin(), older.rend());
    for (size_t i = static_cast<size_t>(opts.keep_last - 1); i < older.size(); ++i) {
      // Rename first, so that a kill during the removal leaves a temp dir, not a half checkpoint.
      const fs::path from = fs::path(dir) / older[i].second;
      const fs::path to = fs::path(dir) / (kTempPrefix + std::string("prune-") + older[i].second +
                                           "-" + files::random_hex(4));
      std::error_code e1, e2;
      fs::rename(from, to, e1);
      if (!e1) fs::remove_all(to, e2);
      if (e1 || e2) {
        core::log::warn("checkpoint: cannot prune '{}': {}", from.string(),
                        (e1 ? e1 : e2).message());
      } else {
        core::log::debug("checkpoint: pruned '{}' (keep_last={})", from.string(), opts.keep_last);
      }
    }
  }

  // ---- the commit (rank 0) ----
  std::string commit(const Job& job, const fs::path& tmp, std::vector<RankIndex> indexes,
                     Clock::time_point commit_by) {
    Metadata m;
    m.step = job.step;
    m.layout = opts.layout;
    m.world = group.world;
    m.config_hash = opts.config_hash;
    m.created = files::utc_now_iso8601();
    m.extra = job.extra;
    if (!opts.config_text.empty()) {
      files::write_durable((tmp / kConfigFile).string(), opts.config_text);
      m.config =
          SideFile{kConfigFile, static_cast<int64_t>(opts.config_text.size()),
                   tensor_io::crc32_update(0, opts.config_text.data(),
                                           static_cast<int64_t>(opts.config_text.size()), false)};
    }
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
              job.step, s.name, dtype_name(t.dtype), t.shape, first_rank[s.name],
              dtype_name(s.dtype), s.shape, idx.rank);
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
          job.step, opts.timeout_s);
    };
    check_deadline();
    const fs::path final_dir = fs::path(dir) / step_dir_name(job.step);
    const bool replaced = files::move_into_place(tmp.string(), final_dir.string());
    files::fsync_path(dir, true);
    files::write_atomic((fs::path(dir) / kLatestFile).string(), step_dir_name(job.step) + "\n",
                        check_deadline);
    if (replaced) {
      std::error_code ec;
      fs::remove_all(tmp, ec);  // the replaced checkpoint of the same step
    }
    prune(job.step);
    return final_dir.string();
  }

  // ---- one save, on the training thread (sync) or the writer thread (async) ----
  SaveStats run(Job& job) {
    core::Stopwatch total;
    SaveStats st;
    st.step = job.step;
    st.entries = static_cast<int64_t>(job.entries.size());
    const int rank = group.rank;
    const bool multi = group.world > 1;
    std::string tmp_name;
    Clock::time_point published{};  // rank 0: when the temporary directory's name was published
    if (rank == 0) {
      try {
        std::error_code ec;
        fs::create_directories(dir, ec);
        if (ec)
          throw_error<IoError>("cannot create checkpoint directory '{}': {}", dir, ec.message());
        remove_leftovers();
        tmp_name = std::string(kTempPrefix) + step_dir_name(job.step) + "-" + files::random_hex(6);
        fs::create_directory(fs::path(dir) / tmp_name, ec);
        if (ec)
          throw_error<IoError>("cannot create '{}': {}", (fs::path(dir) / tmp_name).string(),
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
    } else {
      tmp_name = store_wait_get(job, key(job, "dir"), "the temporary directory");
      if (!tmp_name.empty() && tmp_name[0] == '!') {
        throw_error<CheckpointError>("rank {}: save of step {} failed on rank 0: {}", rank,
                                     job.step, tmp_name.substr(1));
      }
    }
    const fs::path tmp = fs::path(dir) / tmp_name;
    const std::string file = (tmp / rank_file_name(rank)).string();
    RankIndex mine;
    try {
      check_finite(job);
      core::Stopwatch w;
      // A background writer checksums on its own thread only: training owns the other cores.
      mine = write_rank_file(file, rank, job.entries, opts.block_bytes, staging, st.bytes,
                             !opts.async);
      st.write_s = w.elapsed_s();
    } catch (const std::exception& e) {
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
          if (store.check(key(job, "result"), doing(job, "looking for rank 0's result")))
            result = store.get(key(job, "result"), doing(job, "reading rank 0's result"));
        } catch (const std::exception&) {
        }
        if (core::starts_with(result, "error: ")) {
          throw_error<CheckpointError>("rank {}: save of step {} was not committed: {}", rank,
                                       job.step, result.substr(7));
        }
      }
      throw;
    }
    if (multi && rank != 0) {
      store_set(job, key(job, fmt::format("index/{}", rank)), mine.serialize(),
                "publishing this rank's shard index");
      store_add(job, key(job, "ndone"), 1, "counting this rank's file as written");
      const std::string result = store_wait_get(job, key(job, "result"), "the commit");
      store_add(job, key(job, "nack"), 1, "acknowledging the commit");
      if (result.rfind("ok ", 0) != 0) {
        throw_error<CheckpointError>("rank {}: save of step {} was not committed: {}", rank,
                                     job.step, result.substr(std::min<size_t>(result.size(), 7)));
      }
      st.path = result.substr(3);
      st.total_s = total.elapsed_s();
      return st;
    }
    // rank 0: gather, commit, publish.
    try {
      std::vector<RankIndex> indexes{std::move(mine)};
      // The other ranks wait for the commit for at least timeout_s from `published`: past that,
      // no commit.
      const auto commit_by = multi ? published + seconds(opts.timeout_s) : Clock::time_point::max();
      if (multi) gather(job, indexes, commit_by);
      st.path = commit(job, tmp, std::move(indexes), commit_by);
    } catch (const std::exception& e) {
      if (multi) {
        publish_result(job, std::string("error: ") + e.what());
        wait_writers_finished(job);
      }
      std::error_code ec;
      fs::remove_all(tmp, ec);
      throw;
    }
    if (multi) publish_result(job, "ok " + st.path);
    st.total_s = total.elapsed_s();
    return st;
  }

  // Refuses the save when a tensor this rank writes holds NaN or infinity (see the header).
  // Sync saves check the live tensors (GPU ones on their device), async saves their snapshot, on
  // the writer thread and without ATen's intra-op threads.
  void check_finite(const Job& job) const {
    if (opts.allow_nonfinite) return;
    std::vector<at::Tensor> tensors;
    tensors.reserve(job.entries.size());
    for (const OwnedEntry& e : job.entries) tensors.push_back(e.tensor);
    const int64_t bad = first_nonfinite(tensors, /*parallel=*/!opts.async);
    if (bad < 0) return;
    const OwnedEntry& e = job.entries[static_cast<size_t>(bad)];
    const NonFiniteCount c = count_nonfinite(e.tensor);
    throw_error<CheckpointError>(
        "rank {}: save of step {} refused: tensor '{}' holds {} NaN and {} infinite value(s) of "
        "{}; a checkpoint never commits non-finite parameters or optimizer state, so the "
        "previous checkpoints are kept (the run diverged: lower optim.lr or check the data)",
        group.rank, job.step, e.name, c.nan, c.inf, e.tensor.numel());
  }

  // Waits until every other rank finished (index written) or failed its write, or the checkpoint
  // deadline passes (a dead rank never reports); never throws.
  void wait_writers_finished(const Job& job) {
    const auto deadline =
        Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(opts.timeout_s * 1000));
    auto sleep = std::chrono::milliseconds(1);
    try {
      while (store_add(job, key(job, "ndone"), 0, "counting the written files") +
                     store_add(job, key(job, "nfail"), 0, "counting the failed ranks") <
                 group.world - 1 &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(sleep);
        sleep = std::min(sleep * 2, std::chrono::milliseconds(50));
      }
      if (Clock::now() >= deadline) peer_lost();  // a rank never reported: do not wait at exit
    } catch (const std::exception& e) {
      core::log::warn("checkpoint: waiting for the other ranks of step {}: {}", job.step, e.what());
    }
  }

  void publish_result(const Job& job, const std::string& result) {
    try {
      store_set(job, key(job, "result"), result, "publishing the result");
    } catch (const std::exception& e) {
      core::log::warn("checkpoint: cannot publish the result of step {}: {}", job.step, e.what());
    }
  }

  // Waits until `deadline` for the other ranks' shard indexes. Past the deadline it never
  // accepts them, even when they are all there: the other ranks wait for the commit from about
  // when this wait began, so they may have given up (and reported the save as failed) already
  // (rank 0 held up, e.g. stopped, while they waited).
  void gather(const Job& job, std::vector<RankIndex>& indexes, Clock::time_point deadline) {
    auto sleep = std::chrono::milliseconds(1);
    for (;;) {
      const int64_t failed = store_add(job, key(job, "nfail"), 0, "counting the failed ranks");
      if (failed > 0) {
        std::vector<std::string> errs;
        for (int r = 1; r < group.world; ++r) {
          const std::string k = key(job, fmt::format("error/{}", r));
          if (store.check(k, doing(job, "looking for the errors")))
            errs.push_back(store.get(k, doing(job, "reading the errors")));
        }
        throw_error<CheckpointError>("save of step {} failed on {} rank(s): {}", job.step, failed,
                                     core::join(errs, " | "));
      }
      const bool all =
          store_add(job, key(job, "ndone"), 0, "counting the written files") >= group.world - 1;
      if (Clock::now() > deadline) {
        std::vector<int> missing;
        for (int r = 1; r < group.world; ++r) {
          if (!store.check(key(job, fmt::format("index/{}", r)),
                           doing(job, "looking for the missing ranks")))
            missing.push_back(r);
        }
        peer_lost();
        if (missing.empty()) {
          throw_error<TimeoutError>(
              "save of step {}: not committed: rank 0 was held up (stopped or starved) for more "
              "than {:.0f} s (parallel.checkpoint_timeout_s) while the other ranks waited for the "
              "commit, so they may have given up; the last committed checkpoint stays latest",
              job.step, opts.timeout_s);
        }
        throw_error<TimeoutError>(
            "save of step {}: rank(s) {} did not arrive: no shard file within {:.0f} s "
            "(parallel.checkpoint_timeout_s); the last committed checkpoint stays latest",
            job.step, missing, opts.timeout_s);
      }
      if (all) break;
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::milliseconds(50));
    }
    for (int r = 1; r < group.world; ++r) {
      const std::string k = key(job, fmt::format("index/{}", r));
      indexes.push_back(RankIndex::parse(store.get(k, doing(job, "reading a shard index")), r));
      store.remove(k, doing(job, "removing a shard index"));
    }
  }

  // ---- async ----
  Job snapshot(Job job) {
    std::set<c10::DeviceIndex> devices;
    for (OwnedEntry& e : job.entries) {
      const at::Tensor& src = e.tensor;
      // By dataset, not name: a rank's pieces of one tensor each need their own buffer.
      at::Tensor& buf = snapshots[piece_dataset(e.name, e.piece)];
      const bool pinned = src.is_cuda();
      if (!buf.defined() || buf.sizes() != src.sizes() || buf.scalar_type() != src.scalar_type() ||
          (pinned && !buf.is_pinned())) {
        buf = at::empty(src.sizes(),
                        at::TensorOptions().dtype(src.scalar_type()).pinned_memory(pinned));
      }
      buf.copy_(src, /*non_blocking=*/pinned);
      if (src.is_cuda()) devices.insert(src.device().index());
      e.tensor = buf;
    }
    for (const auto d : devices) at::accelerator::synchronizeDevice(d);
    // Drop buffers of entries this save no longer has.
    std::set<std::string> names;
    for (const auto& e : job.entries) names.insert(piece_dataset(e.name, e.piece));
    for (auto it = snapshots.begin(); it != snapshots.end();) {
      it = names.count(it->first) ? std::next(it) : snapshots.erase(it);
    }
    return job;
  }

  void join_worker() {
    if (!running) return;
    worker.join();
    running = false;
    done = false;
  }

  void rethrow() {
    if (error) {
      std::exception_ptr e = error;
      error = nullptr;
      std::rethrow_exception(e);
    }
  }
};

Checkpointer::Checkpointer(std::string checkpoints_dir, CheckpointerOptions options,
                           CommitGroup group)
    : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.dir = std::move(checkpoints_dir);
  I.opts = std::move(options);
  I.group = std::move(group);
  PARALLAX_CHECK(I.group.world >= 1 && I.group.rank >= 0 && I.group.rank < I.group.world,
                 CheckpointError, "checkpoint group: rank {} of world {} is invalid", I.group.rank,
                 I.group.world);
  if (I.opts.layout.world() == 1 && I.group.world > 1) I.opts.layout.dp = I.group.world;
  PARALLAX_CHECK(I.opts.layout.world() == I.group.world, LayoutError,
                 "checkpoint layout {} has {} ranks but the world has {}",
                 I.opts.layout.to_string(), I.opts.layout.world(), I.group.world);
  PARALLAX_CHECK(I.opts.block_bytes >= 4096, CheckpointError,
                 "checkpoint block_bytes {} is below 4096", I.opts.block_bytes);
  PARALLAX_CHECK(I.opts.timeout_s > 0, CheckpointError, "checkpoint timeout {} s is not positive",
                 I.opts.timeout_s);
  if (I.group.world > 1) {
    PARALLAX_CHECK(I.group.store, CheckpointError,
                   "rank {}: checkpoints on {} ranks need the World's out-of-band store, which is "
                   "not available "
                   "(see the warning at start-up)",
                   I.group.rank, I.group.world);
    std::error_code ec;
    const std::string abs = fs::absolute(I.dir, ec).lexically_normal().string();
    // Where the store lives, for messages: the World's store is rank 0's (MPI, torchrun) or a
    // launcher's (an agent store: torchrun's or `parallax launch`'s).
    std::string host = "the checkpoint store";
    if (parallel::comm::World::exists() &&
        parallel::comm::World::current().store().get() == I.group.store.get()) {
      host = parallel::comm::World::current().launch().agent_store ? "the launcher's store"
                                                                   : "hosted by world rank 0";
    }
    auto on_lost = [impl = &I] { impl->peer_lost(); };
    BoundedStore world_store(I.group.store, I.group.rank, host, I.opts.timeout_s, on_lost);
    const int64_t n =
        world_store.add(fmt::format("pxckpt/instance/{}/{}", core::stable_hash(abs), I.group.rank),
                        1, fmt::format("the set-up of checkpoints in '{}'", I.dir));
    I.instance = fmt::format("pxckpt/{}/{}", core::stable_hash(abs), n);
    // A TCPStore connection of its own for the writer; other stores (HashStore in tests) are
    // in-process and thread-safe, and their clone() may not share the data.
    c10::intrusive_ptr<c10d::Store> own = I.group.store;
    if (dynamic_cast<c10d::TCPStore*>(I.group.store.get()) != nullptr)
      own = world_store.clone(fmt::format("the set-up of checkpoints in '{}'", I.dir));
    I.store = BoundedStore(own, I.group.rank, host, I.opts.timeout_s, on_lost);
  }
}

Checkpointer::~Checkpointer() {
  try {
    impl_->join_worker();
    if (impl_->error) {
      try {
        std::rethrow_exception(impl_->error);
      } catch (const std::exception& e) {
        core::log::error("checkpoint: the last background save failed and nobody asked: {}",
                         e.what());
      }
    }
  } catch (...) {
  }
}

void Checkpointer::save(int64_t step, const SaveState& state) {
  Impl& I = *impl_;
  wait();
  PARALLAX_CHECK(step >= 0, CheckpointError, "checkpoint step {} is negative", step);
  core::Stopwatch blocking;
  Impl::Job job;
  job.step = step;
  job.seq = I.seq++;
  job.entries = select_owned(state, I.group.rank, I.group.world);
  job.extra = state.extra();
  if (!I.opts.async) {
    SaveStats st = I.run(job);
    st.blocking_s = blocking.elapsed_s();
    I.last = st;
    core::log::info("checkpoint: saved step {} to '{}' ({} in {:.2f} s)", step, st.path,
                    core::human_bytes(static_cast<double>(st.bytes)), st.total_s);
    return;
  }
  job = I.snapshot(std::move(job));
  const double blocked = blocking.elapsed_s();
  I.running = true;
  I.done = false;
  I.worker = std::thread([&I, job = std::move(job), blocked]() mutable {
    try {
      SaveStats st = I.run(job);
      st.blocking_s = blocked;
      st.total_s +=
          blocked;  // run() times the write; total_s counts from save(), snapshot included
      I.pending = st;
    } catch (...) {
      I.error = std::current_exception();
    }
    I.done = true;
  });
}

void Checkpointer::poll() {
  Impl& I = *impl_;
  if (I.running && I.done.load()) {
    I.join_worker();
    if (!I.error) {
      I.last = I.pending;
      core::log::info("checkpoint: saved step {} to '{}' in the background ({} in {:.2f} s)",
                      I.pending.step, I.pending.path,
                      core::human_bytes(static_cast<double>(I.pending.bytes)), I.pending.total_s);
    }
  }
  I.rethrow();
}

void Checkpointer::wait() {
  Impl& I = *impl_;
  if (I.running) {
    I.join_worker();
    if (!I.error) {
      I.last = I.pending;
      core::log::info("checkpoint: saved step {} to '{}' in the background ({} in {:.2f} s)",
                      I.pending.step, I.pending.path,
                      core::human_bytes(static_cast<double>(I.pending.bytes)), I.pending.total_s);
    }
  }
  I.rethrow();
}

bool Checkpointer::busy() const {
  return impl_->running && !impl_->done.load();
}
std::optional<SaveStats> Checkpointer::last_save() const {
  return impl_->last;
}
const std::string& Checkpointer::dir() const {
  return impl_->dir;
}
const CheckpointerOptions& Checkpointer::options() const {
  return impl_->opts;
}

}  // namespace parallax::checkpoint
