#include "train/metrics.h"

#include "core/error.h"
#include "core/strings.h"

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstring>

namespace parallax::train {

MetricsWriter::MetricsWriter(const std::string& path) : path_(path) {
  file_ = std::fopen(path.c_str(), "a");
  if (!file_) throw_error<IoError>("cannot open metrics file '{}': {}", path, std::strerror(errno));
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

void MetricsWriter::write(const std::string& kind, int64_t step, const std::map<std::string, double>& values) {
  if (!file_) return;
  std::string line = fmt::format("{{\"kind\": {}, \"step\": {}", core::json_quote(kind), step);
  for (const auto& [k, v] : values) {
    if (std::isfinite(v)) line += fmt::format(", {}: {}", core::json_quote(k), v);
    else line += fmt::format(", {}: null", core::json_quote(k));
  }
  line += "}\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    throw_error<IoError>("cannot write metrics to '{}': {}", path_, std::strerror(errno));
  }
}

}  // namespace parallax::train
