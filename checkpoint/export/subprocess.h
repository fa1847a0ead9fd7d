// Running a helper program (the ONNX Runtime parity tool) with a deadline: argv passed as is (no
// shell, so paths need no quoting), stdout and stderr captured together, and the child stopped
// (SIGTERM, then SIGKILL after 5 s) when the deadline passes.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace parallax::checkpoint::exporter {

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

// The last non-empty line of `text` ("" if none).
std::string last_line(const std::string& text);

}  // namespace parallax::checkpoint::exporter
