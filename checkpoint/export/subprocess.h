// Running a helper program (the ONNX Runtime parity tool) with a deadline: argv passed as is (no
// shell, so paths need no quoting), stdout and stderr captured together, and the child stopped
// (SIGTERM, then SIGKILL after 5 s) when the deadline passes.
#pragma once

#include <string>
#include <vector>

namespace parallax::checkpoint::exporter {

struct ProcessResult {
  int exit_code = -1;  // the exit status; 128 + signal when a signal ended it
  bool timed_out = false;
  std::string output;  // stdout and stderr, interleaved as written
};

// Runs argv[0] (looked up on PATH) with argv[1..] and waits at most `timeout_s` seconds. Throws
// parallax::Error when the program cannot be started (naming it and strerror).
ProcessResult run_process(const std::vector<std::string>& argv, double timeout_s);

// The last non-empty line of `text` ("" if none).
std::string last_line(const std::string& text);

}  // namespace parallax::checkpoint::exporter
