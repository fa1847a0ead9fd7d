#include "comm/flight_recorder.h"

#include "core/log.h"
#include "core/strings.h"

#include <fmt/ranges.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace parallax::comm {

FlightRecorder::FlightRecorder(int capacity) : slots_(static_cast<size_t>(std::max(1, capacity))) {}

uint64_t FlightRecorder::record(FlightEntry entry) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_++;
  slots_[id % slots_.size()] = std::move(entry);
  return id;
}

void FlightRecorder::set_state(uint64_t id, OpState state) {
  std::lock_guard<std::mutex> lock(mu_);
  if (id >= next_ || next_ - id > slots_.size()) return;  // overwritten meanwhile
  FlightEntry& e = slots_[id % slots_.size()];
  e.state = state;
  e.finished_at = state == OpState::kIssued ? 0 : wall_seconds();
}

std::vector<FlightEntry> FlightRecorder::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<FlightEntry> out;
  const uint64_t n = std::min<uint64_t>(next_, slots_.size());
  out.reserve(n);
  for (uint64_t id = next_ - n; id < next_; ++id) out.push_back(slots_[id % slots_.size()]);
  return out;
}

uint64_t FlightRecorder::total_recorded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_;
}

std::string to_json(const FlightEntry& e) {
  return fmt::format(
      "{{\"seq\": {}, \"p2p_seq\": {}, \"op\": {}, \"group\": {}, \"detail\": {}, "
      "\"dtype\": {}, \"shape\": [{}], \"bytes\": {}, \"peers\": [{}], \"site\": {}, "
      "\"state\": \"{}\", \"issued_at\": {:.6f}, \"finished_at\": {:.6f}}}",
      e.seq, e.p2p_seq, core::json_quote(e.op), core::json_quote(e.group),
      core::json_quote(e.detail), core::json_quote(e.dtype), fmt::join(e.shape, ", "), e.bytes,
      fmt::join(e.peers, ", "), core::json_quote(e.site), to_string(e.state), e.issued_at,
      e.finished_at);
}

std::string to_json(const std::vector<FlightEntry>& entries) {
  std::string out = "[";
  for (size_t i = 0; i < entries.size(); ++i) {
    out += i ? ",\n    " : "\n    ";
    out += to_json(entries[i]);
  }
  out += entries.empty() ? "]" : "\n  ]";
  return out;
}

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string flight_dump_path(int rank, const std::string& report_dir) {
  std::filesystem::path dir = report_dir.empty() ? "." : report_dir;
  if (const char* env = std::getenv("PARALLAX_FLIGHT_DIR"); env && *env) dir = env;
  return (dir / fmt::format("parallax_flight_{}.json", rank)).string();
}

std::string write_flight_dump(int rank, const std::string& json, const std::string& report_dir) {
  const std::string path = flight_dump_path(rank, report_dir);
  try {
    std::filesystem::path p(path);
    if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
    const std::string tmp = path + ".tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      if (!f) throw std::runtime_error("cannot open " + tmp);
      f << json;
      if (!f.flush()) throw std::runtime_error("cannot write " + tmp);
    }
    std::filesystem::rename(tmp, path);
    return path;
  } catch (const std::exception& e) {
    core::log::error("flight recorder: could not write {}: {}", path, e.what());
    return "";
  }
}

}  // namespace parallax::comm
