// Metrics sink: one JSON object per line in runs/<name>/metrics.jsonl, flushed per record so a
// crashed run keeps everything logged before the crash. Rank 0 writes; other ranks hold a
// disabled writer. Not thread-safe.
//
// Each row exactly once across kills and resumes, by construction:
//   - the trainer sync()s the file (fsync) after the rows of step S and before checkpoint S can
//     commit, so a committed checkpoint S implies rows <= S on disk;
//   - a run that starts at step S (resumed from checkpoint S, or S = 0 for a fresh start) first
//     trims the file to the rows of steps <= S (trim_metrics), then appends: the rows of steps
//     after S that a killed run logged beyond its last checkpoint are logged again, once.
#pragma once

#include "optim/precision.h"

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
  // Writes {"kind": kind, "step": step, <the members of `object`>}; `object` is a JSON object's
  // text (e.g. the load report, checkpoint/weights.h WeightsReport::json).
  void write_json(const std::string& kind, int64_t step, const std::string& object);
  // Makes every row written so far durable (fflush, fsync). Throws IoError. No-op when disabled.
  void sync();
  bool enabled() const { return file_ != nullptr; }

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
};

struct MetricsTrim {
  int64_t kept = 0;     // rows kept (step <= last_step)
  int64_t dropped = 0;  // rows of later steps, and "summary" rows (a resumed run writes its own)
  int64_t broken = 0;   // a torn last line (a kill mid-write) or a line that is not a row
};

// Rewrites the metrics file `path` keeping, in order, the rows whose step is <= `last_step` and
// whose kind is not "summary"; atomic (temporary file, fsync, rename, directory fsync), so a kill
// leaves the old or the new file. Leaves the file untouched when nothing is to be dropped, and
// does nothing when it does not exist. Throws IoError naming the file.
MetricsTrim trim_metrics(const std::string& path, int64_t last_step);

// Peak dense FLOP/s of one H100/H200 (SXM), the MFU denominator, for the precision the matmuls run
// in (precision.mode): bf16 and fp16 on the tensor cores, 989e12; fp32 on the CUDA cores, 67e12
// (Parallax leaves cuBLAS's TF32 off, LibTorch's default, so fp32 matmuls are true fp32).
double peak_flops_per_gpu(optim::Precision mode);

}  // namespace parallax::train
