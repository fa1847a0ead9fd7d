// The preemption signal handler (train/preemption.h) in a forked child process: the first SIGTERM
// only sets the flag, a copy within 2 s counts as the same signal, and a second signal after that
// ends the process at once by the signal's default action (no checkpoint).
#include "train/preemption.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>
#include <csignal>
#include <string>

using parallax::train::PreemptionSignals;

namespace {

// Runs `child` in a forked process and returns its wait status.
template <class Fn>
int run_child(Fn child) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    child();
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

}  // namespace

TEST(PreemptionSignalsTest, TheFirstSignalOnlySetsTheFlagAndACopyWithinTwoSecondsIsTheSame) {
  const int status = run_child([] {
    PreemptionSignals s;
    ::raise(SIGTERM);
    if (!PreemptionSignals::requested() || PreemptionSignals::signal_number() != SIGTERM)
      ::_exit(10);
    ::raise(SIGTERM);  // a copy (Slurm and the launcher both signal): still alive
    ::raise(SIGINT);   // also within the window
    ::_exit(PreemptionSignals::signal_number() == SIGTERM ? 0 : 11);
  });
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(PreemptionSignalsTest, ASecondSignalAfterTheWindowEndsTheProcessAtOnce) {
  const int status = run_child([] {
    PreemptionSignals s;
    ::raise(SIGTERM);
    ::usleep(2'300'000);  // past the 2 s window in which a repeat counts as the same signal
    ::raise(SIGTERM);
    ::_exit(12);  // not reached: the default action of SIGTERM ends the process
  });
  ASSERT_TRUE(WIFSIGNALED(status)) << "exited with " << WEXITSTATUS(status);
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
}

TEST(PreemptionSignalsTest, TheHandlersAreRestoredWhenTheObjectGoes) {
  const int status = run_child([] {
    { PreemptionSignals s; }
    ::raise(SIGTERM);  // the default action again: the process ends by the signal
    ::_exit(13);
  });
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
}

// Issue 35: `parallax eval` and `parallax export` install the handler with their own action, which
// the handler's line names (the training one stays the default).
TEST(PreemptionSignalsTest, TheHandlersLineNamesTheAction) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const int status = run_child([&] {
    ::dup2(fds[1], STDERR_FILENO);
    {
      PreemptionSignals s("stopping the export (nothing is written; exit 143)");
      ::raise(SIGTERM);
    }
    {
      PreemptionSignals s;  // the default: training's
      ::raise(SIGINT);
    }
    ::_exit(PreemptionSignals::requested() ? 0 : 14);
  });
  ::close(fds[1]);
  std::string out;
  char buf[512];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof(buf))) > 0;)
    out.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_NE(out.find("parallax: SIGTERM received: stopping the export (nothing is written; exit "
                     "143); send it again to exit now\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("parallax: SIGINT received: stopping after the current step (checkpoint, then "
                     "exit 143); send it again to exit now\n"),
            std::string::npos)
      << out;
}
