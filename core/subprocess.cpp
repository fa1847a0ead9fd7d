#include "core/subprocess.h"

#include "core/error.h"
#include "core/strings.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

extern char** environ;

namespace parallax::core {

namespace {

using Clock = std::chrono::steady_clock;

// SIGTERM's grace before SIGKILL for the helper programs run_process() starts.
constexpr double kGraceS = 5;

// Closes a file descriptor on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

int status_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Waits for `pid` until `deadline`; true with its status when it ended.
bool wait_until(pid_t pid, Clock::time_point deadline, int& status) {
  while (true) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return true;
    if (r < 0 && errno != EINTR) return true;  // not our child any more: nothing to wait for
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// The running child: stopped and reaped on scope exit unless reaped already (an exception from
// the interruption callback, or any other, never leaves it running).
struct Child {
  pid_t pid = -1;
  ~Child() {
    if (pid > 0) stop_child(pid, kGraceS);
  }
};

}  // namespace

int stop_child(pid_t pid, double grace_s) {
  int status = 0;
  ::kill(pid, SIGTERM);
  ::kill(pid, SIGCONT);  // a stopped child acts on SIGTERM only once it runs again
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(grace_s));
  if (!wait_until(pid, deadline, status)) {
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }  // SIGKILL cannot be ignored: this returns
  }
  return status;
}

ProcessResult run_process(const std::vector<std::string>& argv, double timeout_s,
                          const std::function<void()>& interruption) {
  PARALLAX_CHECK(!argv.empty(), Error, "run_process: empty command");
  int fds[2];
  PARALLAX_CHECK(::pipe2(fds, O_CLOEXEC) == 0, Error, "cannot create a pipe for '{}': {}", argv[0],
                 std::strerror(errno));
  Fd read_end{fds[0]}, write_end{fds[1]};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = ::posix_spawnp(&pid, argv[0].c_str(), &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  PARALLAX_CHECK(rc == 0, Error, "cannot run '{}': {}", argv[0], std::strerror(rc));
  Child child{pid};
  ::close(write_end.fd);
  write_end.fd = -1;

  ProcessResult result;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  char buf[4096];
  bool open = true;
  while (open && Clock::now() < deadline) {
    if (interruption) interruption();
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{read_end.fd, POLLIN, 0};
    const int n =
        ::poll(&p, 1, static_cast<int>(std::min<int64_t>(std::max<int64_t>(left, 1), 100)));
    if (n < 0 && errno != EINTR) break;
    if (n <= 0) continue;
    const ssize_t got = ::read(read_end.fd, buf, sizeof(buf));
    if (got > 0) {
      result.output.append(buf, static_cast<size_t>(got));
    } else if (got == 0 || errno != EINTR) {
      open = false;  // EOF: the child closed its output (normally: it exited)
    }
  }
  int status = 0;
  // The output is closed (normally: the child exited); wait for it in slices, still interruptible.
  while (true) {
    if (interruption) interruption();
    const auto slice = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
    if (wait_until(pid, slice, status)) {
      child.pid = -1;
      result.exit_code = status_code(status);
      return result;
    }
    if (Clock::now() >= deadline) break;
  }
  result.timed_out = true;
  child.pid = -1;
  result.exit_code = status_code(stop_child(pid, kGraceS));
  return result;
}

std::string last_line(const std::string& text) {
  size_t end = text.size();
  while (end > 0) {
    const size_t start = text.rfind('\n', end - 1);
    const std::string line =
        core::trim(text.substr(start == std::string::npos ? 0 : start + 1,
                               end - (start == std::string::npos ? 0 : start + 1)));
    if (!line.empty()) return line;
    if (start == std::string::npos) break;
    end = start;
  }
  return "";
}

}  // namespace parallax::core
