// Metrics sink: one JSON object per line in runs/<name>/metrics.jsonl, flushed per record so a
// crashed run keeps everything logged before the crash. Rank 0 writes; other ranks hold a
// disabled writer. Not thread-safe.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <string>

namespace parallax::train {

class MetricsWriter {
 public:
  MetricsWriter() = default;  // disabled
  // Opens `path` for appending (a resumed run continues the same file). Throws IoError.
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Writes {"kind": kind, "step": step, <values...>}; non-finite values are written as null.
  void write(const std::string& kind, int64_t step, const std::map<std::string, double>& values);
  bool enabled() const { return file_ != nullptr; }

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
};

}  // namespace parallax::train
