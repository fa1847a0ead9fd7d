// Periodic progress lines with rate and ETA for long work (training, data generation, export).
// Prints through the logger (rank 0 only by default) at most every `min_interval_s` seconds, and
// always for the first and the last item. Not thread-safe; call from one thread.
#pragma once

#include "core/timer.h"

#include <cstdint>
#include <string>

namespace parallax::core {

class Progress {
 public:
  // `start` >= 0: the work resumes with that many items already done (a resumed run); rates and
  // the ETA count only what this process does, from now. Otherwise the rate is measured from the
  // first update(), so start-up cost does not skew the ETA.
  Progress(std::string what, int64_t total, double min_interval_s = 5.0, int64_t start = -1);

  // Marks `done` items complete; `extra` is appended to the line (e.g. "loss 0.412").
  void update(int64_t done, const std::string& extra = "");
  // Logs the final line (total time and rate).
  void finish(const std::string& extra = "");

  double elapsed_s() const { return clock_.elapsed_s(); }
  // Seconds left at the current average rate (NaN before the first item).
  double eta_s(int64_t done) const;

 private:
  std::string what_;
  int64_t total_;
  double min_interval_s_;
  Stopwatch clock_;
  double last_print_s_ = -1e9;
  int64_t start_done_ = -1;
  double start_s_ = 0;
  int64_t resumed_at_ = 0;  // items done before this process (the `start` argument)
};

}  // namespace parallax::core
