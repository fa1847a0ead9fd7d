// The worker processes of one launcher node (worker_process.h).
#include "launch/worker_process.h"

#include "core/strings.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <deque>
#include <fstream>
#include <utility>

extern char** environ;

namespace parallax::launch {

std::vector<std::string> inherited_worker_env(double startup_timeout_s) {
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string k = kv.substr(0, kv.find('='));
    static const char* kDropped[] = {"RANK",
                                     "WORLD_SIZE",
                                     "LOCAL_RANK",
                                     "LOCAL_WORLD_SIZE",
                                     "GROUP_RANK",
                                     "GROUP_WORLD_SIZE",
                                     "ROLE_RANK",
                                     "ROLE_WORLD_SIZE",
                                     "MASTER_ADDR",
                                     "MASTER_PORT",
                                     "PMIX_RANK",
                                     "PMI_RANK",
                                     "TORCHELASTIC_RESTART_COUNT",
                                     "TORCHELASTIC_MAX_RESTARTS",
                                     "TORCHELASTIC_USE_AGENT_STORE",
                                     "TORCHELASTIC_RUN_ID"};
    bool drop = core::starts_with(k, "OMPI_COMM_WORLD_") ||
                (startup_timeout_s > 0 && k == "PARALLAX_STARTUP_TIMEOUT");
    for (const char* d : kDropped) drop = drop || k == d;
    if (!drop) base.push_back(kv);
  }
  if (startup_timeout_s > 0)
    base.push_back(fmt::format("PARALLAX_STARTUP_TIMEOUT={}", startup_timeout_s));
  return base;
}

std::vector<std::string> torchrun_env(const WorkerPlace& p) {
  const std::pair<const char*, std::string> vars[] = {
      {"RANK", std::to_string(p.rank)},
      {"WORLD_SIZE", std::to_string(p.world_size)},
      {"LOCAL_RANK", std::to_string(p.local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(p.nproc_per_node)},
      {"GROUP_RANK", std::to_string(p.node_rank)},
      {"GROUP_WORLD_SIZE", std::to_string(p.nnodes)},
      {"ROLE_RANK", std::to_string(p.rank)},
      {"ROLE_WORLD_SIZE", std::to_string(p.world_size)},
      {"MASTER_ADDR", p.master_addr},
      {"MASTER_PORT", std::to_string(p.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(p.attempt)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(p.max_restarts)},
      {"TORCHELASTIC_USE_AGENT_STORE", "True"},
      {"TORCHELASTIC_RUN_ID", "parallax"},
  };
  std::vector<std::string> env;
  for (const auto& [k, v] : vars) env.push_back(fmt::format("{}={}", k, v));
  return env;
}

pid_t start_worker(const std::string& exe, std::vector<std::string> args,
                   std::vector<std::string> env, const std::string& log_path) {
  std::vector<char*> envp;
  for (auto& s : env) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  // fork + execve rather than posix_spawn for PR_SET_PDEATHSIG: a launcher that is killed
  // (SIGKILL, the OOM killer) takes its workers with it instead of leaving them holding GPUs.
  // Between fork and exec only async-signal-safe calls (the store's threads exist).
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Own process group: a Ctrl-C on the terminal reaches the launcher only, which forwards it
    // once (the worker would read a second copy as "exit now").
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the launcher died before prctl
    const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    const int nul = ::open("/dev/null", O_RDONLY);
    if (log < 0 || nul < 0) ::_exit(126);
    ::dup2(log, STDOUT_FILENO);
    ::dup2(log, STDERR_FILENO);
    ::dup2(nul, STDIN_FILENO);
    ::close_range(3, ~0U, 0);  // the store's sockets and anything else of the launcher
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(SIGTERM, &dfl, nullptr);
    ::sigaction(SIGINT, &dfl, nullptr);
    ::sigaction(SIGPIPE, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execve(exe.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }
  if (pid > 0) ::setpgid(pid, pid);  // also from the parent, so that kill(-pid) works at once
  return pid;
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return fmt::format("died on signal {} (SIG{})", sig, name ? name : "?");
  }
  return fmt::format("exited with code {}", WEXITSTATUS(status));
}

std::string tail_lines(const std::string& file, int n) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return "  | (no log)\n";
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  const std::streamoff start = std::max<std::streamoff>(0, size - 65536);
  in.seekg(start);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::deque<std::string> lines;
  for (const auto& l : core::split(text, '\n')) {
    if (l.empty()) continue;
    // Progress lines redraw with '\r': the last redraw is the line.
    const auto cr = l.find_last_of('\r', l.size() >= 2 ? l.size() - 2 : 0);
    lines.push_back(cr == std::string::npos ? l : l.substr(cr + 1));
    if (static_cast<int>(lines.size()) > n) lines.pop_front();
  }
  std::string out;
  for (const auto& l : lines) out += "  | " + core::clip(l, 400) + "\n";
  return out.empty() ? "  | (empty log)\n" : out;
}

}  // namespace parallax::launch
