// Test helper for tests/data/test_nuscenes_nds.py: Parallax's detection metrics (the code
// `parallax eval` and the trainer's eval report them with: DetectionApMetric, detection_tp_errors,
// add_detection_metrics) on boxes given as text, so they can be compared with nuscenes-devkit's
// DetectionEval on the same boxes.
//
//   nds_tool ROWS          prints the metrics as one JSON object (NaN as null)
//
// ROWS, whitespace-separated, one record a line (numbers as C's strtod reads them: "nan" too):
//   classes NAME...                                          the class names, index = class id
//   pred sample class x y z l w h yaw score row vx vy        data/detection_score.h's pred row
//   gt sample class x y z l w h yaw vx vy                    its gt row
// Exit 1 with "parallax: error: ..." on bad input.
#include "core/error.h"
#include "data/detection_score.h"
#include "data/metrics.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

using namespace parallax;

namespace {

double number(const std::string& s, const std::string& where) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || *end != '\0' || errno == ERANGE)
    throw_error<Error>("nds_tool: {}: '{}' is not a number", where, s);
  return v;
}

struct Input {
  std::vector<std::string> classes;
  std::vector<double> pred, gt;
};

Input read_rows(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw_error<Error>("nds_tool: cannot read '{}'", path);
  Input in;
  std::string line;
  for (int64_t n = 1; std::getline(f, line); ++n) {
    std::istringstream ss(line);
    std::string kind, tok;
    if (!(ss >> kind)) continue;
    const std::string where = fmt::format("{}:{}", path, n);
    std::vector<std::string> toks;
    while (ss >> tok) toks.push_back(tok);
    if (kind == "classes") {
      in.classes = toks;
      continue;
    }
    const size_t want = kind == "pred" ? data::kTpPredColumns : data::kTpGtColumns;
    if ((kind != "pred" && kind != "gt") || toks.size() != want)
      throw_error<Error>("nds_tool: {}: expected 'pred' and {} numbers or 'gt' and {}", where,
                         data::kTpPredColumns, data::kTpGtColumns);
    auto& out = kind == "pred" ? in.pred : in.gt;
    for (const auto& t : toks) out.push_back(number(t, where));
  }
  if (in.classes.empty()) throw_error<Error>("nds_tool: '{}' has no 'classes' line", path);
  return in;
}

at::Tensor rows(std::vector<double>& v, int64_t cols) {
  const auto n = static_cast<int64_t>(v.size()) / cols;
  if (n == 0) return at::empty({0, cols}, at::kDouble);
  return at::from_blob(v.data(), {n, cols}, at::kDouble).clone();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc != 2) throw_error<Error>("usage: nds_tool ROWS");
    Input in = read_rows(argv[1]);
    const at::Tensor pred = rows(in.pred, data::kTpPredColumns);
    const at::Tensor gt = rows(in.gt, data::kTpGtColumns);
    // As train/evaluate.cpp feeds them: AP from (sample, class, x, y, score, row) and
    // (sample, class, x, y); the errors from the full rows.
    data::DetectionApMetric ap(static_cast<int64_t>(in.classes.size()));
    ap.merge({{"pred", at::cat({pred.narrow(1, 0, 4), pred.narrow(1, 9, 2)}, 1)},
              {"gt", gt.narrow(1, 0, 4)}});
    const data::TpErrors tp = data::detection_tp_errors(pred, gt, in.classes, 2.0);
    std::map<std::string, double> m;
    data::add_detection_metrics(ap.compute(), tp, in.classes, m);
    std::string out = "{";
    for (const auto& [k, v] : m) {
      out += fmt::format("{}\"{}\": {}", out.size() > 1 ? ", " : "", k,
                         std::isfinite(v) ? fmt::format("{}", v) : "null");
    }
    std::puts((out + "}").c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "parallax: error: %s\n", e.what());
    return 1;
  }
}
