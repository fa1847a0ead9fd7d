#include "comm/startup.h"

#include "core/error.h"
#include "core/log.h"

#include <fmt/format.h>

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace parallax::comm {

double startup_deadline_s(double init_timeout_s, double timeout_s) {
  double s = std::min(init_timeout_s, timeout_s);
  if (const char* v = std::getenv("PARALLAX_STARTUP_TIMEOUT"); v && *v) {
    char* end = nullptr;
    const double env = std::strtod(v, &end);
    PARALLAX_CHECK(end && *end == '\0' && env > 0 && env < 1e9, ConfigError,
                   "environment variable PARALLAX_STARTUP_TIMEOUT='{}' is not a positive number of "
                   "seconds (the start-up deadline; `parallax launch --startup-timeout` sets it)",
                   std::string(v).substr(0, 40));
    s = std::min(s, env);
  }
  return s;
}

namespace {

struct Proc {
  int pid = 0;
  char state = '?';
  int ppid = 0;
};

// /proc/<pid>/stat: "pid (comm) S ppid ..."; comm may hold spaces and parentheses.
std::optional<Proc> read_stat(int pid) {
  std::ifstream f(fmt::format("/proc/{}/stat", pid));
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  if (close == std::string::npos || close + 4 > text.size()) return std::nullopt;
  Proc p;
  p.pid = pid;
  p.state = text[close + 2];
  p.ppid = std::atoi(text.c_str() + close + 4);
  return p;
}

// The integer value of `var` in /proc/<pid>/environ (NUL-separated), if readable and present.
std::optional<int> env_int(int pid, const std::string& var) {
  std::ifstream f(fmt::format("/proc/{}/environ", pid), std::ios::binary);
  std::string env((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::string key = var + "=";
  for (std::size_t at = 0; at < env.size();) {
    const std::size_t end = std::min(env.find('\0', at), env.size());
    if (env.compare(at, key.size(), key) == 0) {
      const std::string v = env.substr(at + key.size(), end - at - key.size());
      char* stop = nullptr;
      const long n = std::strtol(v.c_str(), &stop, 10);
      if (!v.empty() && stop && *stop == '\0') return static_cast<int>(n);
      return std::nullopt;
    }
    at = end + 1;
  }
  return std::nullopt;
}

const char* rank_variable(Launcher l) {
  switch (l) {
    case Launcher::kOpenMpi:
      return "OMPI_COMM_WORLD_RANK";
    case Launcher::kTorchrun:
      return "RANK";
    case Launcher::kSlurm:
      return "SLURM_PROCID";
    case Launcher::kSingle:
      break;
  }
  return nullptr;
}

const char* state_text(char s) {
  switch (s) {
    case 'T':
      return "is stopped (SIGSTOP or SIGTSTP)";
    case 't':
      return "is stopped by a debugger";
    case 'Z':
    case 'X':
      return "has exited";
    case 'D':
      return "is blocked in uninterruptible I/O";
    default:
      return "is running";
  }
}

}  // namespace

std::string startup_stragglers(const LaunchInfo& launch) {
  const char* var = rank_variable(launch.launcher);
  if (!var || launch.world_size <= 1) return "";
  // This host's other ranks: the processes started by the same launcher process as this one.
  const int self = static_cast<int>(::getpid());
  const int parent = static_cast<int>(::getppid());
  std::vector<std::pair<int, Proc>> peers;  // (rank, process)
  if (DIR* d = ::opendir("/proc")) {
    while (dirent* e = ::readdir(d)) {
      char* end = nullptr;
      const long pid = std::strtol(e->d_name, &end, 10);
      if (!end || *end != '\0' || pid <= 0 || pid == self) continue;
      const auto p = read_stat(static_cast<int>(pid));
      if (!p || p->ppid != parent) continue;
      if (const auto r = env_int(p->pid, var); r && *r != launch.rank) peers.emplace_back(*r, *p);
    }
    ::closedir(d);
  }
  std::sort(peers.begin(), peers.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::string> parts;
  for (const auto& [rank, p] : peers) {
    if (parts.size() == 8) {
      parts.push_back(fmt::format("{} more", peers.size() - 8));
      break;
    }
    parts.push_back(fmt::format("rank {} (pid {}) {}", rank, p.pid, state_text(p.state)));
  }
  const int local_missing =
      std::max(0, launch.local_world_size - 1 - static_cast<int>(peers.size()));
  if (local_missing > 0)
    parts.push_back(
        fmt::format("{} rank(s) of this host not found (not started yet, or gone)", local_missing));
  const int remote = launch.world_size - launch.local_world_size;
  if (remote > 0)
    parts.push_back(fmt::format("{} rank(s) run on other hosts (not visible from here)", remote));
  if (parts.empty()) return "";
  std::string out = "; on this host: ";
  for (std::size_t i = 0; i < parts.size(); ++i) out += (i ? ", " : "") + parts[i];
  return out;
}

namespace detail {
struct StartupPhaseState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
};
}  // namespace detail

StartupPhase::StartupPhase(std::string phase, double deadline_s, const LaunchInfo& launch) {
  state_ = std::make_shared<detail::StartupPhaseState>();
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double>(deadline_s));
  core::log::debug("start-up: {} (deadline {:.0f} s)", phase, deadline_s);
  thread_ = std::thread([state = state_, until, phase = std::move(phase), deadline_s, launch] {
    std::unique_lock<std::mutex> lock(state->mu);
    if (state->cv.wait_until(lock, until, [&] { return state->done; })) return;
    const std::string line = fmt::format(
        "parallax: error: rank {} of {}: start-up did not finish: {} still waited after {:.0f} s, "
        "the start-up deadline (the smallest of parallel.init_timeout_s, parallel.timeout_s and "
        "PARALLAX_STARTUP_TIMEOUT){}; a rank that is stopped, swapped out or stuck during "
        "start-up holds every other rank here\n",
        launch.rank, launch.world_size, phase, deadline_s, startup_stragglers(launch));
    std::fputs(line.c_str(), stderr);
    std::fflush(nullptr);
    std::_Exit(1);
  });
}

StartupPhase::~StartupPhase() {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->done = true;
  }
  state_->cv.notify_all();
  thread_.join();
}

}  // namespace parallax::comm
