#include "core/progress.h"

#include "core/log.h"
#include "core/strings.h"

#include <cmath>

namespace parallax::core {

Progress::Progress(std::string what, int64_t total, double min_interval_s, int64_t start)
    : what_(std::move(what)), total_(total), min_interval_s_(min_interval_s) {
  if (start >= 0) {
    start_done_ = start;
    resumed_at_ = start;
  }
}

double Progress::eta_s(int64_t done) const {
  if (start_done_ < 0 || done <= start_done_) return NAN;
  const double rate = (done - start_done_) / std::max(1e-9, clock_.elapsed_s() - start_s_);
  return (total_ - done) / rate;
}

void Progress::update(int64_t done, const std::string& extra) {
  const double now = clock_.elapsed_s();
  if (start_done_ < 0) {
    // The rate is measured from the first update, so start-up cost does not skew the ETA.
    start_done_ = done;
    start_s_ = now;
  }
  const bool first = last_print_s_ < -1e8;
  if (!first && done < total_ && now - last_print_s_ < min_interval_s_) return;
  last_print_s_ = now;
  const double pct =
      total_ > 0 ? 100.0 * static_cast<double>(done) / static_cast<double>(total_) : 0.0;
  const double rate =
      done > start_done_ ? (done - start_done_) / std::max(1e-9, now - start_s_) : NAN;
  log::info("{} {}/{} ({:.0f}%) | {} | {} | elapsed {} | ETA {}", what_, done, total_, pct,
            std::isnan(rate) ? std::string("--/s") : fmt::format("{:.2f}/s", rate),
            extra.empty() ? std::string("-") : extra, human_duration(now),
            human_duration(eta_s(done)));
}

void Progress::finish(const std::string& extra) {
  const double t = clock_.elapsed_s();
  // Only the items of this process count in its rate (a resumed run did the others earlier).
  const int64_t here = total_ - resumed_at_;
  if (resumed_at_ > 0 && here <= 0) {
    log::info("{}: nothing to do, {} of {} were done before this process", what_, resumed_at_,
              total_);
    return;
  }
  const std::string resumed =
      resumed_at_ > 0 ? fmt::format(" ({} in this process, resumed at {})", here, resumed_at_) : "";
  log::info("{} done: {}{} in {} ({:.2f}/s){}", what_, total_, resumed, human_duration(t),
            t > 0 ? static_cast<double>(here) / t : 0.0, extra.empty() ? "" : " | " + extra);
}

}  // namespace parallax::core
