#include "parallel/comm/world.h"

#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"
#include "parallel/comm/comm_base.h"
#include "parallel/comm/deadline_call.h"
#include "parallel/comm/startup.h"
#include "parallel/comm/world_context.h"

#include <ATen/Context.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Logging.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>

namespace parallax::parallel::comm {

// ---- launch detection ------------------------------------------------------------------------

const char* to_string(Launcher launcher) {
  switch (launcher) {
    case Launcher::kSingle:
      return "single process";
    case Launcher::kOpenMpi:
      return "OpenMPI";
    case Launcher::kTorchrun:
      return "torchrun";
    case Launcher::kSlurm:
      return "Slurm";
  }
  return "?";
}

std::string LaunchInfo::describe() const {
  std::string s = fmt::format("{}: rank {}/{}, local rank {}/{}", to_string(launcher), rank,
                              world_size, local_rank, local_world_size);
  if (use_mpi) return s + ", rendezvous through MPI";
  return s + fmt::format(", store {}:{}{}", master_addr, master_port,
                         agent_store ? " (agent store)" : "");
}

namespace {

class EnvReader {
 public:
  explicit EnvReader(const GetEnv& getenv) : getenv_(getenv) {}

  bool has(const char* name) const {
    const char* v = get(name);
    return v && *v;
  }
  const char* get(const char* name) const { return getenv_ ? getenv_(name) : std::getenv(name); }
  std::string str(const char* name, const std::string& fallback = "") const {
    const char* v = get(name);
    return v && *v ? std::string(v) : fallback;
  }
  // Integer variable; `fallback` when unset; CommError naming the variable when malformed.
  int integer(const char* name, std::optional<int> fallback, const char* launcher) const {
    const char* v = get(name);
    if (!v || !*v) {
      if (fallback) return *fallback;
      throw_error<CommError>(
          "{} launch: environment variable {} is not set (needed to know this process's place "
          "in the job)",
          launcher, name);
    }
    int out = 0;
    const char* end = v + std::strlen(v);
    auto [ptr, ec] = std::from_chars(v, end, out);
    if (ec != std::errc() || ptr != end) {
      throw_error<CommError>("{} launch: environment variable {}='{}' is not an integer", launcher,
                             name, v);
    }
    return out;
  }

 private:
  const GetEnv& getenv_;
};

void validate(const LaunchInfo& info, const char* what) {
  PARALLAX_CHECK(info.world_size >= 1, CommError, "{} launch: world size {} must be at least 1",
                 what, info.world_size);
  PARALLAX_CHECK(info.rank >= 0 && info.rank < info.world_size, CommError,
                 "{} launch: rank {} is outside the world of {} ranks", what, info.rank,
                 info.world_size);
  PARALLAX_CHECK(
      info.local_world_size >= 1 && info.local_rank >= 0 && info.local_rank < info.local_world_size,
      CommError, "{} launch: local rank {} is outside the {} local ranks", what, info.local_rank,
      info.local_world_size);
}

void read_master(const EnvReader& env, LaunchInfo& info, const char* what) {
  info.master_addr = env.str("MASTER_ADDR");
  info.master_port =
      env.integer("MASTER_PORT", info.world_size == 1 ? std::optional<int>(0) : std::nullopt, what);
  if (info.master_addr.empty()) {
    PARALLAX_CHECK(info.world_size == 1, CommError,
                   "{} launch without MPI: MASTER_ADDR is not set (rank {} of {} needs the address "
                   "of rank 0's "
                   "TCPStore; set MASTER_ADDR and MASTER_PORT)",
                   what, info.rank, info.world_size);
    info.master_addr = "127.0.0.1";
  }
  PARALLAX_CHECK(info.master_port >= 0 && info.master_port < 65536, CommError,
                 "{} launch: MASTER_PORT={} is not a TCP port", what, info.master_port);
}

}  // namespace

LaunchInfo detect_launch(const GetEnv& getenv) {
  EnvReader env(getenv);
  LaunchInfo info;
  if (env.has("OMPI_COMM_WORLD_SIZE")) {
    const char* w = "OpenMPI";
    info.launcher = Launcher::kOpenMpi;
    info.world_size = env.integer("OMPI_COMM_WORLD_SIZE", std::nullopt, w);
    info.rank = env.integer("OMPI_COMM_WORLD_RANK", std::nullopt, w);
    info.local_rank = env.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0, w);
    info.local_world_size = env.integer("OMPI_COMM_WORLD_LOCAL_SIZE", 1, w);
    info.use_mpi = true;
    validate(info, w);
    return info;
  }
  if (env.has("RANK") && env.has("WORLD_SIZE")) {
    const char* w = "torchrun";
    info.launcher = Launcher::kTorchrun;
    info.rank = env.integer("RANK", std::nullopt, w);
    info.world_size = env.integer("WORLD_SIZE", std::nullopt, w);
    info.local_rank = env.integer("LOCAL_RANK", info.rank, w);
    info.local_world_size = env.integer("LOCAL_WORLD_SIZE", info.world_size, w);
    info.use_mpi = false;
    info.agent_store = env.str("TORCHELASTIC_USE_AGENT_STORE") == "True";
    read_master(env, info, w);
    validate(info, w);
    return info;
  }
  if (env.has("SLURM_PROCID") && env.has("SLURM_NTASKS")) {
    const char* w = "Slurm";
    info.launcher = Launcher::kSlurm;
    info.rank = env.integer("SLURM_PROCID", std::nullopt, w);
    info.world_size = env.integer("SLURM_NTASKS", std::nullopt, w);
    info.local_rank = env.integer("SLURM_LOCALID", 0, w);
    // SLURM_NTASKS_PER_NODE can read "4" or "4(x2)"; SLURM_STEP_TASKS_PER_NODE likewise.
    std::string per_node = env.str("SLURM_NTASKS_PER_NODE", env.str("SLURM_STEP_TASKS_PER_NODE"));
    info.local_world_size = std::max(1, info.local_rank + 1);
    if (!per_node.empty()) {
      int n = 0;
      auto [ptr, ec] = std::from_chars(per_node.data(), per_node.data() + per_node.size(), n);
      if (ec == std::errc() && n > info.local_rank) info.local_world_size = n;
    }
    info.use_mpi = env.has("PMIX_RANK") || env.has("PMI_RANK");
    if (!info.use_mpi) read_master(env, info, w);
    validate(info, w);
    return info;
  }
  info.launcher = Launcher::kSingle;
  info.use_mpi = env.str("PARALLAX_MPI", "1") != "0";
  return info;
}

// ---- SeqBoard --------------------------------------------------------------------------------

namespace detail {

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

// ---- WorldContext ----------------------------------------------------------------------------

void WorldContext::set_report_dir(std::string dir) {
  std::lock_guard<std::mutex> lock(mu_);
  report_dir_ = std::move(dir);
}

std::string WorldContext::report_dir() {
  std::lock_guard<std::mutex> lock(mu_);
  return report_dir_;
}

void WorldContext::register_comm(CommBase* comm) {
  std::lock_guard<std::mutex> lock(mu_);
  comms_.push_back(comm);
}

void WorldContext::unregister_comm(CommBase* comm) {
  std::lock_guard<std::mutex> lock(mu_);
  comms_.erase(std::remove(comms_.begin(), comms_.end(), comm), comms_.end());
}

std::string WorldContext::flight_json(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = fmt::format(
      "{{\n\"rank\": {}, \"world_size\": {}, \"time\": {:.6f},\n\"reason\": {},\n"
      "\"communicators\": [",
      rank, size, wall_seconds(), core::json_quote(reason));
  for (size_t i = 0; i < comms_.size(); ++i) {
    CommBase* c = comms_[i];
    out += fmt::format(
        "{}\n {{\"name\": \"{}\", \"uid\": \"{}\", \"backend\": \"{}\", \"rank\": {}, \"size\": "
        "{}, "
        "\"world_ranks\": [{}], \"aborted\": {},\n  \"entries\": {}}}",
        i ? "," : "", c->name(), c->uid(), c->backend(), c->rank(), c->size(),
        fmt::join(c->world_ranks(), ", "), c->aborted() ? "true" : "false",
        to_json(c->flight_entries()));
  }
  out += "\n]\n}\n";
  return out;
}

void WorldContext::release_all() {
  std::vector<CommBase*> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    comms = comms_;
  }
  if (!comms.empty()) {
    core::log::debug("world shutdown: releasing {} communicator(s) still alive", comms.size());
  }
  for (CommBase* c : comms) c->release_backend();
}

void WorldContext::add_progressable(const std::shared_ptr<Progressable>& p) {
  std::lock_guard<std::mutex> lock(progress_mu_);
  progress_.push_back(p);
}

void WorldContext::progress_all() {
  std::vector<std::shared_ptr<Progressable>> live;
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    if (progress_.empty()) return;
    live.reserve(progress_.size());
    for (auto& w : progress_) {
      if (auto p = w.lock()) live.push_back(std::move(p));
    }
  }
  std::vector<Progressable*> finished;
  for (auto& p : live) {
    if (p->progress_noexcept()) finished.push_back(p.get());
  }
  std::lock_guard<std::mutex> lock(progress_mu_);
  progress_.erase(std::remove_if(progress_.begin(), progress_.end(),
                                 [&](const std::weak_ptr<Progressable>& w) {
                                   auto p = w.lock();
                                   return !p || std::find(finished.begin(), finished.end(),
                                                          p.get()) != finished.end();
                                 }),
                  progress_.end());
}

void WorldContext::bury(std::shared_ptr<void> keep_alive) {
  if (!keep_alive) return;
  std::lock_guard<std::mutex> lock(mu_);
  graveyard_.push_back(std::move(keep_alive));
}

std::string WorldContext::next_world_uid(const std::string& backend) {
  std::lock_guard<std::mutex> lock(mu_);
  int n = world_counts_[backend]++;
  return fmt::format("world.{}.{}", backend, n);
}

namespace {

// Polls an MPI request until done or `timeout_s` passes (CommError naming `what`).
void mpi_wait_for(MPI_Request* req, double timeout_s, const std::string& what,
                  const LaunchInfo* launch = nullptr) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  int done = 0;
  int spins = 0;
  while (true) {
    MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (done) return;
    if (Clock::now() > deadline) {
      throw_error<TimeoutError>(
          "{} timed out after {:.1f} s (init timeout): not every rank arrived{}", what, timeout_s,
          launch ? startup_stragglers(*launch) : "");
    }
    if (++spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

}  // namespace

std::vector<uint8_t> WorldContext::broadcast_from_root(std::vector<uint8_t> bytes,
                                                       const std::string& key, double timeout_s) {
  if (size == 1) return bytes;
  if (mpi) {
    int64_t n = static_cast<int64_t>(bytes.size());
    MPI_Request req;
    MPI_Ibcast(&n, 1, MPI_INT64_T, 0, MPI_COMM_WORLD, &req);
    mpi_wait_for(&req, timeout_s, fmt::format("broadcast of '{}' from rank 0", key), &launch);
    bytes.resize(static_cast<size_t>(n));
    MPI_Ibcast(bytes.data(), static_cast<int>(n), MPI_BYTE, 0, MPI_COMM_WORLD, &req);
    mpi_wait_for(&req, timeout_s, fmt::format("broadcast of '{}' from rank 0", key));
    return bytes;
  }
  PARALLAX_CHECK(store, CommError, "rank {}: no MPI and no store to share '{}' from rank 0", rank,
                 key);
  const std::string k = "pxc/bcast/" + key;
  if (rank == 0) {
    store->set(k, bytes);
    return bytes;
  }
  try {
    store->wait({k}, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  } catch (const std::exception& e) {
    throw_error<TimeoutError>(
        "rank {}: waiting for '{}' from rank 0 through the store timed out after {:.1f} s: {}{}",
        rank, key, timeout_s, one_line_what(e), startup_stragglers(launch));
  }
  return store->get(k);
}

}  // namespace detail

// ---- World -----------------------------------------------------------------------------------

namespace {

World* g_world = nullptr;

// Runs the store call `f` (which owns what it uses) until `deadline` (call_with_deadline): a
// TimeoutError names `what` when the store does not answer, a CommError carries a failing call's
// one-line text.
template <class F>
auto bounded_store_call(const char* what, detail::Clock::time_point deadline, F f)
    -> decltype(f()) {
  try {
    if (auto r = call_with_deadline(std::move(f), deadline)) return *r;
  } catch (const std::exception& e) {
    throw_error<CommError>("the store failed during {}: {}", what, one_line_what(e));
  }
  throw_error<TimeoutError>("the store did not answer in time during {} (is its host stopped?)",
                            what);
}

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

std::chrono::milliseconds ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

c10::intrusive_ptr<c10d::Store> make_store(detail::WorldContext& ctx) {
  const LaunchInfo& l = ctx.launch;
  c10d::TCPStoreOptions o;
  o.timeout = ms(ctx.init_timeout_s);
  o.waitWorkers = false;
  o.numWorkers = static_cast<size_t>(ctx.size);
  if (!ctx.mpi && l.launcher != Launcher::kSingle) {
    // torchrun style: rank 0 hosts the store at MASTER_ADDR:MASTER_PORT (or the agent does).
    o.port = static_cast<uint16_t>(l.master_port);
    o.isServer = ctx.rank == 0 && !l.agent_store;
    try {
      auto tcp = c10::make_intrusive<c10d::TCPStore>(l.master_addr, o);
      if (!l.agent_store) return tcp;
      // The agent's store (torchrun's, or `parallax launch`'s) outlives restarts: each attempt's
      // keys live under /worker/attempt_<TORCHELASTIC_RESTART_COUNT>, as torchrun's workers put
      // them, so a restarted group never reads the previous group's keys.
      const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
      return c10::make_intrusive<c10d::PrefixStore>(
          fmt::format("/worker/attempt_{}", attempt && *attempt ? attempt : "0"), tcp);
    } catch (const std::exception& e) {
      throw_error<CommError>(
          "rank {}: cannot {} the TCPStore at {}:{} within {:.0f} s (init timeout): {}{}", ctx.rank,
          o.isServer ? "host" : "reach", l.master_addr, l.master_port, ctx.init_timeout_s,
          one_line_what(e), startup_stragglers(l));
    }
  }
  // MPI (or a single process): rank 0 hosts the store, its address travels through MPI.
  std::string advertised;
  const std::string me = host_name();
  if (const char* a = std::getenv("PARALLAX_STORE_ADDR"); a && *a) {
    advertised = a;
  } else if (const char* m = std::getenv("MASTER_ADDR"); m && *m) {
    advertised = m;
  } else {
    advertised = me;
  }
  c10::intrusive_ptr<c10d::Store> store;
  std::string msg;
  if (ctx.rank == 0) {
    o.isServer = true;
    o.port = 0;
    if (const char* p = std::getenv("PARALLAX_STORE_PORT"); p && *p)
      o.port = static_cast<uint16_t>(std::atoi(p));
    try {
      auto tcp = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
      msg = fmt::format("{}\n{}\n{}", advertised, tcp->getPort(), me);
      store = tcp;
    } catch (const std::exception& e) {
      msg = fmt::format("!{}", one_line_what(e));
    }
  }
  std::vector<uint8_t> bytes(msg.begin(), msg.end());
  bytes = ctx.broadcast_from_root(std::move(bytes), "store", ctx.init_timeout_s);
  msg.assign(bytes.begin(), bytes.end());
  if (!msg.empty() && msg[0] == '!')
    throw_error<CommError>("rank 0 could not host the TCPStore: {}", msg.substr(1));
  if (ctx.rank == 0) return store;
  auto parts = std::vector<std::string>();
  size_t start = 0;
  for (size_t i = 0; i <= msg.size(); ++i) {
    if (i == msg.size() || msg[i] == '\n') {
      parts.push_back(msg.substr(start, i - start));
      start = i + 1;
    }
  }
  PARALLAX_CHECK(parts.size() == 3, CommError, "rank {}: malformed store address '{}' from rank 0",
                 ctx.rank, msg);
  const std::string addr = parts[2] == me ? std::string("127.0.0.1") : parts[0];
  o.isServer = false;
  o.port = static_cast<uint16_t>(std::atoi(parts[1].c_str()));
  try {
    return c10::make_intrusive<c10d::TCPStore>(addr, o);
  } catch (const std::exception& e) {
    throw_error<CommError>(
        "rank {}: cannot reach rank 0's TCPStore at {}:{} within {:.0f} s (set PARALLAX_STORE_ADDR "
        "to an address of rank 0's host reachable from here): {}",
        ctx.rank, addr, o.port, ctx.init_timeout_s, one_line_what(e));
  }
}

}  // namespace

World::World(WorldOptions options) : ctx_(std::make_shared<detail::WorldContext>()) {
  ctx_->uncaught_at_start = std::uncaught_exceptions();
  PARALLAX_CHECK(g_world == nullptr, CommError,
                 "a parallax World already exists in this process (create one, in main)");
#ifndef C10_USE_GFLAGS
  // c10d logs each failed store call as a warning with a C++ stack trace (e.g. when the store's
  // host exits first at teardown). Parallax reports store failures itself, in one line, so c10's
  // threshold is raised to errors unless the user chose one (TORCH_CPP_LOG_LEVEL).
  if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr)
    FLAGS_caffe2_log_level = std::max(FLAGS_caffe2_log_level, 2);
#endif
  auto& c = *ctx_;
  c.launch = detect_launch();
  c.init_timeout_s = startup_deadline_s(options.init_timeout_s, options.init_timeout_s);
  c.rank = c.launch.rank;
  c.size = c.launch.world_size;
  if (c.launch.use_mpi) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      {
        // MPI_Init_thread has no deadline of its own: it waits in the launcher's fence for every
        // rank of the job, and one stopped before it would hold this rank forever.
        StartupPhase phase("MPI initialisation (MPI_Init_thread waits for every rank of the job)",
                           c.init_timeout_s, c.launch);
        MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      }
      c.mpi_owned = true;
      if (provided < MPI_THREAD_SERIALIZED) {
        MPI_Finalize();
        throw_error<CommError>(
            "MPI provides thread level {} but Parallax needs at least MPI_THREAD_SERIALIZED",
            provided);
      }
    }
    c.mpi = true;
    int r = 0, n = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (c.launch.launcher != Launcher::kSingle && (r != c.rank || n != c.size)) {
      if (c.mpi_owned) MPI_Finalize();
      throw_error<CommError>("{} says rank {}/{} but MPI says rank {}/{}", c.launch.describe(),
                             c.rank, c.size, r, n);
    }
    c.rank = r;
    c.size = n;
    c.launch.rank = r;
    c.launch.world_size = n;
  }
  core::log::set_rank(c.rank, c.size);

  if (at::hasCUDA()) {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    c.cuda_devices = impl.deviceCount();
    if (c.cuda_devices > 0) {
      c.device = c10::Device(c10::DeviceType::CUDA,
                             static_cast<c10::DeviceIndex>(c.launch.local_rank % c.cuda_devices));
      if (options.set_device) impl.setDevice(*c.device);
    }
  }

  if (options.store) {
    try {
      c.store = make_store(c);
      c.board = std::make_unique<detail::SeqBoard>(c.store, c.rank);
    } catch (const Error& e) {
      if (!c.mpi) {
        if (c.mpi_owned) MPI_Finalize();
        throw;
      }
      // Under MPI the store only serves hang reports (and gloo/NCCL ids, which then use MPI).
      core::log::warn("no out-of-band store, hang reports will not name missing ranks: {}",
                      one_line_what(e));
      c.store.reset();
    }
  }
  g_world = this;
  core::log::debug("world: {}", c.launch.describe());
}

World::~World() {
  auto& c = *ctx_;
  c.shut_down = true;
  c.release_all();
  c.board.reset();
  bool failed = c.failed.load();
  // Destroyed by an exception (this rank leaves with an error): its peers may be waiting for it
  // inside a step and never reach the exit barrier, so it waits there at most kErrorExitS (ranks
  // that failed together still meet and finalise MPI) and past that leaves without finalising, so
  // main prints the error line within that time and the launcher tears the job down.
  constexpr double kErrorExitS = 5;
  const bool unwinding = std::uncaught_exceptions() > c.uncaught_at_start;
  const double exit_timeout_s =
      unwinding ? std::min(kErrorExitS, c.init_timeout_s) : c.init_timeout_s;
  if (!failed && c.size > 1) {
    // Exit barrier: rank 0 hosts the store; it must outlive every other rank's use of it.
    try {
      if (c.mpi) {
        MPI_Request req;
        MPI_Ibarrier(MPI_COMM_WORLD, &req);
        detail::mpi_wait_for(&req, exit_timeout_s, "world shutdown barrier");
      } else if (c.store) {
        // Two phases: everyone arrives, then everyone but rank 0 acknowledges having seen that, so
        // rank 0 (the store's host) is the last to stop using the store. Every store call is
        // bounded by the barrier's deadline (the store's host may be stopped).
        const auto deadline =
            detail::Clock::now() +
            std::chrono::milliseconds(static_cast<int64_t>(exit_timeout_s * 1000));
        auto add = [&](const char* key, int64_t n) {
          return bounded_store_call(
              "a counter update", deadline,
              [s = c.store, k = std::string(key), n] { return s->add(k, n); });
        };
        add("pxc/exit", 1);
        while (add("pxc/exit", 0) < c.size && detail::Clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        if (c.rank != 0) {
          add("pxc/exit_ack", 1);
        } else {
          while (add("pxc/exit_ack", 0) < c.size - 1 && detail::Clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
          }
        }
      }
    } catch (const std::exception& e) {
      // One line: the store's host may be gone (it exited first, or died); c10's backtrace is
      // not for users.
      core::log::warn("world shutdown barrier failed: {}", one_line_what(e));
      // A peer that never arrived may be inside a collective: MPI_Finalize would wait for it.
      failed = true;
    }
  }
  c.store.reset();
  if (c.mpi_owned) {
    if (failed) {
      core::log::error(
          "a communicator or the exit barrier timed out or failed on this rank: not finalising "
          "MPI (a peer may be stuck inside a collective); the launcher will terminate the job");
    } else {
      MPI_Finalize();
    }
  }
  g_world = nullptr;
}

World& World::current() {
  PARALLAX_CHECK(g_world != nullptr, CommError,
                 "no parallax World in this process: create parallax::parallel::comm::World at the "
                 "top of main()");
  return *g_world;
}

bool World::exists() {
  return g_world != nullptr;
}
int World::rank() const {
  return ctx_->rank;
}
int World::size() const {
  return ctx_->size;
}
int World::local_rank() const {
  return ctx_->launch.local_rank;
}
const LaunchInfo& World::launch() const {
  return ctx_->launch;
}
bool World::has_mpi() const {
  return ctx_->mpi;
}
std::optional<c10::Device> World::device() const {
  return ctx_->device;
}
int World::cuda_device_count() const {
  return ctx_->cuda_devices;
}
c10::intrusive_ptr<c10d::Store> World::store() const {
  return ctx_->store;
}
bool World::comm_failed() const {
  return ctx_->failed.load();
}

void World::set_report_dir(const std::string& dir) {
  ctx_->set_report_dir(dir);
}

void World::abort(int code) {
  std::fflush(nullptr);
  if (ctx_->mpi) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace parallax::parallel::comm
