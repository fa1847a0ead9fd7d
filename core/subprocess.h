// Child processes with deadlines. run_process(): a helper program (the export's ONNX Runtime
// parity tool) run with argv as is (no shell, so paths need no quoting), stdout and stderr captured
// together, and the child stopped (SIGTERM, then SIGKILL after 5 s) when the deadline passes.
// stop_child(): the same stop for any child (`parallax quantize`'s runs).
#pragma once

#include <sys/types.h>

#include <functional>
#include <string>
#include <vector>

namespace parallax::core {

struct ProcessResult {
  int exit_code = -1;  // the exit status; 128 + signal when a signal ended it
  bool timed_out = false;
  std::string output;  // stdout and stderr, interleaved as written
};

// Runs argv[0] (looked up on PATH) with argv[1..] and waits at most `timeout_s` seconds. Throws
// parallax::Error when the program cannot be started (naming it and strerror). `interruption`
// (optional) is called about every 100 ms while the program runs: when it throws (e.g. on
// preemption), the program is stopped as at the deadline and the exception propagates.
ProcessResult run_process(const std::vector<std::string>& argv, double timeout_s,
                          const std::function<void()>& interruption = {});

// Stops child process `pid` (of this process): SIGTERM, with SIGCONT so that a stopped child acts
// on it, then SIGKILL when it has not ended after `grace_s` seconds; reaps it and returns its wait
// status. Used by run_process() at its deadline and by `parallax quantize` for its child runs.
int stop_child(pid_t pid, double grace_s);

// The last non-empty line of `text` ("" if none).
std::string last_line(const std::string& text);

}  // namespace parallax::core
