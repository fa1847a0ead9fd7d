// The launcher agent of one node (agent.h): the watch over this node's workers (worker_process.h
// starts them), the group's teardown, and the restart and preemption decisions it takes with the
// other nodes' agents through the store (launch_store.h).
#include "launch/agent.h"

#include "core/error.h"
#include "launch/exit_codes.h"
#include "launch/launch_store.h"
#include "launch/worker_process.h"

#include <ATen/Context.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Logging.h>
#include <fmt/format.h>

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <thread>

namespace fs = std::filesystem;

namespace parallax::launch {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int> g_signals{0};  // SIGTERM/SIGINT received by the launcher
std::atomic<int> g_first_signal{0};

extern "C" void on_launcher_signal(int sig) {
  int expected = 0;
  g_first_signal.compare_exchange_strong(expected, sig);
  g_signals.fetch_add(1);
}

// Installs the launcher's SIGTERM/SIGINT handlers for its lifetime (restores the previous ones).
class SignalScope {
 public:
  SignalScope() {
    g_signals = 0;
    g_first_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_launcher_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0;  // no SA_RESTART: sleeps end early, the loop looks at the flag
    ::sigaction(SIGTERM, &sa, &term_);
    ::sigaction(SIGINT, &sa, &intr_);
  }
  ~SignalScope() {
    ::sigaction(SIGTERM, &term_, nullptr);
    ::sigaction(SIGINT, &intr_, nullptr);
  }

 private:
  struct sigaction term_ {};
  struct sigaction intr_ {};
};

std::chrono::milliseconds ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

void sleep_s(double seconds) {
  std::this_thread::sleep_for(ms(seconds));
}

struct Worker {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  std::string log;
};

class Agent {
 public:
  explicit Agent(const AgentOptions& o) : o_(o), world_(o.nproc_per_node * o.nnodes) {}

  int run();

 private:
  // ---- workers -------------------------------------------------------------------------------
  void spawn(int attempt);
  void reap();  // collects exited workers (never blocks)
  bool any_running() const;
  void signal_all(int sig);
  void teardown(double grace_s);
  void kill_all();  // SIGKILL, then reaps for at most 30 s
  void tee_console();
  // Returns the attempt's outcome: nullopt when every node's workers succeeded.
  std::optional<Failure> monitor(int attempt);
  // Waits for the workers to checkpoint and exit. `forward`: send them SIGTERM first (only when
  // this launcher was signalled: elsewhere the workers' world-wide vote stops them, and a second
  // SIGTERM would make a worker exit without its checkpoint).
  Failure preempt_wait(Failure f, bool forward);

  void say(const std::string& line) {
    std::fprintf(stderr, "parallax: launch: node %d: %s\n", o_.node_rank, line.c_str());
    std::fflush(stderr);
  }
  void leave();

  AgentOptions o_;
  int world_;
  int port_ = 0;
  std::unique_ptr<LaunchStore> store_;
  std::vector<Worker> workers_;
  std::string tee_file_;
  std::streamoff tee_offset_ = 0;
  int forwarded_ = 0;  // launcher signals already acted on
};

void Agent::spawn(int attempt) {
  workers_.clear();
  std::error_code ec;
  fs::create_directories(o_.log_dir, ec);
  PARALLAX_CHECK(!ec, IoError, "launch: node {}: cannot create the log folder '{}': {}",
                 o_.node_rank, o_.log_dir, ec.message());
  // The environment every worker shares; launcher-specific variables are replaced.
  const std::vector<std::string> base = inherited_worker_env(o_.startup_timeout_s);
  for (int local = 0; local < o_.nproc_per_node; ++local) {
    Worker w;
    w.local_rank = local;
    w.rank = o_.node_rank * o_.nproc_per_node + local;
    w.log = (fs::path(o_.log_dir) / fmt::format("rank_{}.log", w.rank)).string();
    WorkerPlace place;
    place.rank = w.rank;
    place.local_rank = local;
    place.world_size = world_;
    place.nproc_per_node = o_.nproc_per_node;
    place.node_rank = o_.node_rank;
    place.nnodes = o_.nnodes;
    place.master_addr = o_.master_addr;
    place.master_port = port_;
    place.attempt = attempt;
    place.max_restarts = o_.max_restarts;
    std::vector<std::string> env = base;
    for (auto& kv : torchrun_env(place)) env.push_back(std::move(kv));
    std::vector<std::string> args = {o_.exe};
    args.insert(args.end(), o_.worker_args.begin(), o_.worker_args.end());

    {  // A header per attempt, so a log that spans restarts reads in order.
      std::ofstream log(w.log, std::ios::app);
      log << fmt::format(
          "==== parallax launch: attempt {}, rank {} (node {}, local rank {}) ====\n", attempt,
          w.rank, o_.node_rank, local);
    }
    if (local == 0) {
      tee_file_ = w.log;
      std::error_code sec;
      tee_offset_ = static_cast<std::streamoff>(fs::file_size(w.log, sec));
    }
    const pid_t pid = start_worker(o_.exe, std::move(args), std::move(env), w.log);
    if (pid < 0) {
      const int err = errno;
      throw_error<Error>("launch: node {}: cannot start rank {} ('{}'): {}", o_.node_rank, w.rank,
                         o_.exe, std::strerror(err));
    }
    w.pid = pid;
    w.running = true;
    workers_.push_back(w);
  }
}

void Agent::reap() {
  for (auto& w : workers_) {
    if (!w.running) continue;
    int status = 0;
    const pid_t r = ::waitpid(w.pid, &status, WNOHANG);
    if (r == w.pid) {
      w.running = false;
      w.status = status;
    }
  }
}

bool Agent::any_running() const {
  for (const auto& w : workers_)
    if (w.running) return true;
  return false;
}

void Agent::signal_all(int sig) {
  for (const auto& w : workers_)
    if (w.running) ::kill(-w.pid, sig);  // the worker's process group (it and its children)
}

void Agent::kill_all() {
  signal_all(SIGKILL);
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (any_running() && Clock::now() < deadline) {
    reap();
    sleep_s(0.02);
  }
  for (const auto& w : workers_) {
    if (w.running)
      say(fmt::format("rank {} (pid {}) did not die within 30 s of SIGKILL (uninterruptible I/O?)",
                      w.rank, w.pid));
  }
}

void Agent::teardown(double grace_s) {
  if (!any_running()) return;
  signal_all(SIGTERM);
  const auto deadline = Clock::now() + ms(grace_s);
  while (any_running() && Clock::now() < deadline) {
    reap();
    tee_console();
    sleep_s(0.02);
  }
  if (any_running()) {
    say(fmt::format("workers still running {:.0f} s after SIGTERM: SIGKILL", grace_s));
    kill_all();
  }
  tee_console();
}

void Agent::tee_console() {
  if (tee_file_.empty()) return;
  std::ifstream in(tee_file_, std::ios::binary);
  if (!in) return;
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size <= tee_offset_) return;
  in.seekg(tee_offset_);
  std::string buf(static_cast<size_t>(size - tee_offset_), '\0');
  in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
  tee_offset_ += in.gcount();
  std::fwrite(buf.data(), 1, static_cast<size_t>(in.gcount()), stderr);
  std::fflush(stderr);
}

Failure Agent::preempt_wait(Failure f, bool forward) {
  // Every worker finishes its step, saves, and exits kExitPreempted; a second launcher signal
  // (or the timeout) kills them.
  if (forward) signal_all(SIGTERM);
  forwarded_ = forward ? std::max(1, g_signals.load()) : g_signals.load();
  const auto deadline = Clock::now() + ms(o_.preempt_timeout_s);
  while (any_running()) {
    reap();
    tee_console();
    const int sigs = g_signals.load();
    if (sigs > forwarded_ && forwarded_ == 0) {
      say("signal received: forwarding SIGTERM to the workers");
      signal_all(SIGTERM);
      forwarded_ = sigs;
    } else if (sigs > forwarded_) {
      say("second signal: killing the workers without waiting for their checkpoint");
      kill_all();
      break;
    }
    if (Clock::now() > deadline) {
      say(fmt::format("workers did not stop within {:.0f} s of the preemption signal: SIGKILL",
                      o_.preempt_timeout_s));
      kill_all();
      break;
    }
    sleep_s(std::min(o_.monitor_interval_s, 0.05));
  }
  tee_console();
  for (const auto& w : workers_) {
    const bool ok = WIFEXITED(w.status) &&
                    (WEXITSTATUS(w.status) == kExitPreempted || WEXITSTATUS(w.status) == 0);
    if (!ok) {
      say(fmt::format("during preemption rank {} {} (its checkpoint may be missing)", w.rank,
                      describe_status(w.status)));
    }
  }
  return f;
}

std::optional<Failure> Agent::monitor(int attempt) {
  const std::string done_key = fmt::format("launch/done/{}", attempt);
  bool counted_done = false;
  Clock::time_point done_deadline{};
  while (true) {
    reap();
    tee_console();
    // 1. The launcher itself was signalled: preemption of every node.
    if (g_signals.load() > forwarded_) {
      const int sig = g_first_signal.load();
      const char* name = sigabbrev_np(sig);
      say(fmt::format(
          "SIG{} received: forwarding SIGTERM to the workers (checkpoint, then exit {}); "
          "send it again to kill them",
          name ? name : "?", kExitPreempted));
      Failure f{FailureKind::kPreempt, o_.node_rank,
                fmt::format("node {} launcher received SIG{}", o_.node_rank, name ? name : "?")};
      store_->record_failure(attempt, f);
      return preempt_wait(f, /*forward=*/true);
    }
    // 2. A local worker ended.
    for (const auto& w : workers_) {
      if (w.running) continue;
      if (WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0) continue;
      Failure f;
      f.node = o_.node_rank;
      const int code = WIFEXITED(w.status) ? WEXITSTATUS(w.status) : -1;
      if (code == kExitPreempted) {
        f.kind = FailureKind::kPreempt;
        f.text = fmt::format("node {} rank {} stopped for preemption", o_.node_rank, w.rank);
        store_->record_failure(attempt, f);
        return preempt_wait(f, /*forward=*/false);
      }
      // 126/127: the binary could not be started (the same next time).
      f.kind = code == kExitDeterministic || code == kExitUsage || code == 126 || code == 127
                   ? FailureKind::kDeterministic
                   : FailureKind::kFail;
      f.text = fmt::format("node {} rank {} (local rank {}, pid {}) {}", o_.node_rank, w.rank,
                           w.local_rank, w.pid, describe_status(w.status));
      std::fprintf(stderr,
                   "parallax: launch: worker failed: %s (attempt %d); last lines of %s:\n%s",
                   f.text.c_str(), attempt, w.log.c_str(), tail_lines(w.log, 10).c_str());
      std::fflush(stderr);
      auto [recorded, mine] = store_->record_failure(attempt, f);
      (void)mine;
      teardown(o_.grace_period_s);
      return recorded;
    }
    // 3. Another node reported a failure or a preemption.
    if (auto f = store_->read_failure(attempt); f && f->node != o_.node_rank) {
      if (f->kind == FailureKind::kPreempt) {
        say(fmt::format("{}: waiting for the workers' checkpoint", f->text));
        return preempt_wait(*f, /*forward=*/false);
      }
      say(fmt::format("stopping the workers: {}", f->text));
      teardown(o_.grace_period_s);
      return f;
    }
    // 4. Every local worker succeeded: wait for the other nodes (or a failure among them).
    if (!any_running()) {
      if (!counted_done) {
        store_->counter(done_key, 1);
        counted_done = true;
        done_deadline = Clock::now() + ms(o_.rdzv_timeout_s);
      }
      if (store_->counter(done_key, 0) >= o_.nnodes) return std::nullopt;
      if (Clock::now() > done_deadline) {
        throw_error<TimeoutError>(
            "launch: node {}: this node's workers finished but only {} of {} nodes did within "
            "{:.0f} s",
            o_.node_rank, store_->counter(done_key, 0), o_.nnodes, o_.rdzv_timeout_s);
      }
    }
    sleep_s(o_.monitor_interval_s);
  }
}

void Agent::leave() {
  // Node 0 hosts the store: it stays until every agent has read the outcome (bounded).
  try {
    store_->counter("launch/bye", 1);
    if (o_.node_rank == 0 && o_.nnodes > 1) {
      store_->wait_counter("launch/bye", o_.nnodes, Clock::now() + std::chrono::seconds(30),
                           [] { return false; });
    }
  } catch (const std::exception&) {
    // node 0 already gone: nothing left to coordinate
  }
}

int Agent::run() {
  SignalScope signals;
  store_ = std::make_unique<LaunchStore>(o_.master_addr, o_.master_port, o_.node_rank,
                                         o_.rdzv_timeout_s, std::min(o_.monitor_interval_s, 0.05));
  port_ = store_->port();
  say(fmt::format("{} worker(s) of {} (nodes {}), store {}:{}{}, logs in {}", o_.nproc_per_node,
                  world_, o_.nnodes, o_.master_addr, port_,
                  o_.node_rank == 0 ? " (hosted here)" : "", o_.log_dir));
  for (int attempt = 0;; ++attempt) {
    // Every node joins each attempt before any spawns it (also: all finished the last teardown).
    const std::string join = fmt::format("launch/join/{}", attempt);
    store_->counter(join, 1);
    const bool joined = store_->wait_counter(join, o_.nnodes, Clock::now() + ms(o_.rdzv_timeout_s),
                                             [] { return g_signals.load() > 0; });
    if (g_signals.load() > 0) {
      say("signal received before the workers started: exiting");
      leave();
      return kExitPreempted;
    }
    PARALLAX_CHECK(joined, TimeoutError,
                   "launch: node {}: only {} of {} nodes joined attempt {} within {:.0f} s "
                   "(--rdzv-timeout); check --nnodes, --node-rank and --master on every node",
                   o_.node_rank, store_->counter(join, 0), o_.nnodes, attempt, o_.rdzv_timeout_s);
    std::optional<Failure> outcome;
    try {
      spawn(attempt);
      outcome = monitor(attempt);
    } catch (...) {
      teardown(o_.grace_period_s);
      throw;
    }
    if (!outcome) {
      say("all workers finished");
      leave();
      return kExitOk;
    }
    if (outcome->kind == FailureKind::kPreempt) {
      say(fmt::format("preempted ({}): exit {}", outcome->text, kExitPreempted));
      leave();
      return kExitPreempted;
    }
    if (outcome->kind == FailureKind::kDeterministic) {
      std::fprintf(stderr,
                   "parallax: error: launch: %s: a deterministic failure (config, layout or data "
                   "error, exit code %d or %d), not restarted\n",
                   outcome->text.c_str(), kExitDeterministic, kExitUsage);
      leave();
      return kExitDeterministic;
    }
    // The global budget: the agent whose failure was recorded counts the restart; every agent
    // reads the same count.
    if (outcome->node == o_.node_rank) store_->counter("launch/restarts", 1);
    const bool counted = store_->wait_counter(
        "launch/restarts", attempt + 1, Clock::now() + ms(o_.rdzv_timeout_s), [] { return false; });
    PARALLAX_CHECK(
        counted, TimeoutError,
        "launch: node {}: node {} did not count the restart of attempt {} within {:.0f} s",
        o_.node_rank, outcome->node, attempt, o_.rdzv_timeout_s);
    if (attempt + 1 > o_.max_restarts) {
      std::fprintf(stderr,
                   "parallax: error: launch: restart budget exhausted: %s after %d restart(s) "
                   "(--max-restarts %d)\n",
                   outcome->text.c_str(), attempt, o_.max_restarts);
      leave();
      return kExitRestartsExhausted;
    }
    say(fmt::format("restarting all {} node(s): restart {} of {} ({})", o_.nnodes, attempt + 1,
                    o_.max_restarts, outcome->text));
  }
}

}  // namespace

std::string self_exe() {
  char buf[PATH_MAX] = {};
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  PARALLAX_CHECK(n > 0, Error, "launch: cannot resolve /proc/self/exe to start the workers");
  return std::string(buf, static_cast<size_t>(n));
}

int usable_cpu_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

int visible_cuda_devices() {
  if (!at::hasCUDA()) return 0;
  return static_cast<int>(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).deviceCount());
}

int run_agent(const AgentOptions& options) {
#ifndef C10_USE_GFLAGS
  // c10d logs failed store calls with stack traces; the launcher reports them in one line.
  if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr)
    FLAGS_caffe2_log_level = std::max(FLAGS_caffe2_log_level, 2);
#endif
  Agent agent(options);
  return agent.run();
}

}  // namespace parallax::launch
