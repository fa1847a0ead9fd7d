#include "data/detection_score.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace parallax::data {

std::vector<double> nan_cummean(const std::vector<double>& x) {
  const bool all_nan = std::all_of(x.begin(), x.end(), [](double v) { return std::isnan(v); });
  if (all_nan) return std::vector<double>(x.size(), 1.0);
  // numpy.nancumsum over numpy.cumsum(~isnan): 0 where no number has been seen yet.
  std::vector<double> out(x.size());
  double sum = 0;
  int64_t count = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isnan(x[i])) {
      sum += x[i];
      ++count;
    }
    out[i] = count > 0 ? sum / static_cast<double>(count) : 0.0;
  }
  return out;
}

double nan_mean(const std::vector<double>& v) {
  double sum = 0;
  int64_t n = 0;
  for (double x : v) {
    if (std::isnan(x)) continue;
    sum += x;
    ++n;
  }
  return n > 0 ? sum / static_cast<double>(n) : std::numeric_limits<double>::quiet_NaN();
}

namespace {

constexpr double kPi = 3.14159265358979323846;

// The devkit's angle_diff: (a - b + period / 2) mod period - period / 2 (Python's %: the sign of
// the divisor), shifted from (pi, 2 pi] to (-pi, 0]; absolute value.
double yaw_error(double gt, double pred, double period) {
  double d = std::fmod(gt - pred + period / 2, period);
  if (d < 0) d += period;
  d -= period / 2;
  if (d > kPi) d -= 2 * kPi;
  return std::fabs(d);
}

// The devkit's calc_tp for one class: `errors` of the true positives in score order, `conf` their
// scores, `rec` and `all_conf` the recall and score after each prediction (all predictions).
double class_tp_error(const std::vector<double>& errors, const std::vector<double>& conf,
                      const std::vector<double>& rec, const std::vector<double>& all_conf) {
  if (errors.empty()) return 1.0;
  constexpr int kPoints = 101;
  // Confidence at each recall point (numpy.interp(rec_interp, rec, conf, right=0)).
  std::vector<double> conf_at(kPoints);
  int max_recall_ind = -1;
  for (int i = 0; i < kPoints; ++i) {
    const double x = i == kPoints - 1 ? 1.0 : i * 0.01;
    conf_at[static_cast<size_t>(i)] = interp(x, rec, all_conf, all_conf.front(), 0.0);
    if (conf_at[static_cast<size_t>(i)] != 0) max_recall_ind = i;
  }
  const int first = 11;  // round(100 * min_recall) + 1
  if (max_recall_ind < first) return 1.0;
  // NaN-aware running mean, then numpy.interp(conf_at[::-1], conf[::-1], cummean[::-1])[::-1]:
  // the matched scores reversed are ascending.
  const std::vector<double> mean = nan_cummean(errors);
  const std::vector<double> xp(conf.rbegin(), conf.rend()), fp(mean.rbegin(), mean.rend());
  double total = 0;
  for (int i = first; i <= max_recall_ind; ++i)
    total += interp(conf_at[static_cast<size_t>(i)], xp, fp, fp.front(), fp.back());
  return total / static_cast<double>(max_recall_ind - first + 1);
}

// Row accessors over the accepted layouts (kTpPredColumns / kTpGtColumns, or without velocity).
struct Rows {
  const double* data;
  int64_t n, cols;
  const double* row(int64_t i) const { return data + i * cols; }
};

// One class's greedy matching (DetectionApMetric's order and rule) and its five error lists.
struct ClassMatch {
  std::vector<double> ate, ase, aoe, ave, aae, conf, rec, all_conf;
  int64_t npos = 0;
};

ClassMatch match_class(const Rows& pred, const Rows& gt, int64_t c, double threshold,
                       double period) {
  ClassMatch m;
  std::map<int64_t, std::vector<const double*>> gt_by_sample;
  for (int64_t i = 0; i < gt.n; ++i) {
    const double* row = gt.row(i);
    if (std::lround(row[1]) != c) continue;
    gt_by_sample[std::lround(row[0])].push_back(row);
    ++m.npos;
  }
  std::vector<const double*> preds;
  for (int64_t i = 0; i < pred.n; ++i) {
    if (std::lround(pred.row(i)[1]) == c) preds.push_back(pred.row(i));
  }
  // The order of DetectionApMetric::compute: score descending, then sample, then row.
  std::stable_sort(preds.begin(), preds.end(), [](const double* a, const double* b) {
    if (a[9] != b[9]) return a[9] > b[9];
    if (a[0] != b[0]) return a[0] < b[0];
    return a[10] < b[10];
  });
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::map<int64_t, std::vector<bool>> taken;
  double ctp = 0;
  for (const double* q : preds) {
    const int64_t sample = std::lround(q[0]);
    const auto it = gt_by_sample.find(sample);
    double best = std::numeric_limits<double>::infinity();
    int64_t best_i = -1;
    if (it != gt_by_sample.end()) {
      auto& tk = taken[sample];
      tk.resize(it->second.size(), false);
      for (size_t i = 0; i < it->second.size(); ++i) {
        if (tk[i]) continue;
        const double dist = std::hypot(it->second[i][2] - q[2], it->second[i][3] - q[3]);
        if (dist < best) {
          best = dist;
          best_i = static_cast<int64_t>(i);
        }
      }
    }
    if (best < threshold) {
      taken[sample][static_cast<size_t>(best_i)] = true;
      const double* g = it->second[static_cast<size_t>(best_i)];
      m.ate.push_back(best);
      const double inter = std::min(g[5], q[5]) * std::min(g[6], q[6]) * std::min(g[7], q[7]);
      m.ase.push_back(1.0 - inter / (g[5] * g[6] * g[7] + q[5] * q[6] * q[7] - inter));
      m.aoe.push_back(yaw_error(g[8], q[8], period));
      // Without velocity columns: the prediction says (0, 0), the ground truth is unknown.
      const double pvx = pred.cols > 11 ? q[11] : 0.0, pvy = pred.cols > 11 ? q[12] : 0.0;
      const double gvx = gt.cols > 9 ? g[9] : nan, gvy = gt.cols > 9 ? g[10] : nan;
      m.ave.push_back(std::hypot(pvx - gvx, pvy - gvy));  // NaN where either is NaN
      m.aae.push_back(nan);  // no ground-truth attribute (detection_score.h)
      m.conf.push_back(q[9]);
      ctp += 1;
    }
    m.rec.push_back(m.npos > 0 ? ctp / static_cast<double>(m.npos) : 0.0);
    m.all_conf.push_back(q[9]);
  }
  return m;
}

}  // namespace

TpErrors detection_tp_errors(const at::Tensor& pred_in, const at::Tensor& gt_in,
                             const std::vector<std::string>& class_names, double threshold) {
  const at::Tensor pred = pred_in.to(at::kCPU).to(at::kDouble).contiguous();
  const at::Tensor gt = gt_in.to(at::kCPU).to(at::kDouble).contiguous();
  const bool pred_ok = pred.dim() == 2 && (pred.size(1) == kTpPredColumns || pred.size(1) == 11);
  const bool gt_ok = gt.dim() == 2 && (gt.size(1) == kTpGtColumns || gt.size(1) == 9);
  if (!pred_ok || !gt_ok) {
    throw_error<Error>(
        "detection_tp_errors: expected pred [P, 13] (or [P, 11]) and gt [G, 11] (or [G, 9]); got "
        "[{}], [{}]",
        fmt::join(pred.sizes(), ", "), fmt::join(gt.sizes(), ", "));
  }
  const Rows p{pred.data_ptr<double>(), pred.size(0), pred.size(1)};
  const Rows g{gt.data_ptr<double>(), gt.size(0), gt.size(1)};
  const double nan = std::numeric_limits<double>::quiet_NaN();
  TpErrors r;
  for (size_t c = 0; c < class_names.size(); ++c) {
    const std::string& name = class_names[c];
    // The devkit's exceptions (detection/evaluate.py) and barrier's orientation period.
    const bool cone = name == "traffic_cone", barrier = name == "barrier";
    const ClassMatch m =
        match_class(p, g, static_cast<int64_t>(c), threshold, barrier ? kPi : 2 * kPi);
    // No ground truth or no true positive: the devkit's no_predictions, error 1.
    const bool none = m.npos == 0 || m.ate.empty();
    auto err = [&](const std::vector<double>& e) {
      return none ? 1.0 : class_tp_error(e, m.conf, m.rec, m.all_conf);
    };
    r.ate.push_back(err(m.ate));
    r.ase.push_back(err(m.ase));
    r.aoe.push_back(cone ? nan : err(m.aoe));
    r.ave.push_back(cone || barrier ? nan : err(m.ave));
    r.aae.push_back(cone || barrier ? nan : err(m.aae));
  }
  r.mate = nan_mean(r.ate);
  r.mase = nan_mean(r.ase);
  r.maoe = nan_mean(r.aoe);
  r.mave = nan_mean(r.ave);
  r.maae = nan_mean(r.aae);
  return r;
}

DetectionScore detection_score(double map, const TpErrors& tp) {
  // max(1 - err, 0), and 0 for a NaN mean (every class exempt), as Python's max(0.0, nan).
  auto score = [](double err) { return std::isnan(err) ? 0.0 : std::max(1.0 - err, 0.0); };
  // The devkit's order: the five scores summed (TP_METRICS order), then added to 5 mAP.
  const double four = score(tp.mate) + score(tp.mase) + score(tp.maoe) + score(tp.mave);
  DetectionScore s;
  s.nds = (5 * map + (four + score(tp.maae))) / 10;
  s.nds_no_aae = (5 * map + four) / 9;
  return s;
}

void add_detection_metrics(const DetectionResult& r, const TpErrors& tp,
                           const std::vector<std::string>& class_names,
                           std::map<std::string, double>& m) {
  m["map"] = r.map;
  for (size_t t = 0; t < r.thresholds.size(); ++t)
    m[fmt::format("map_{}m", r.thresholds[t])] = r.map_at[t];
  for (size_t c = 0; c < r.ap.size() && c < class_names.size(); ++c) {
    const std::string& name = class_names[c];
    for (size_t t = 0; t < r.thresholds.size(); ++t) {
      if (r.thresholds[t] == 2.0) m["ap_2m_" + name] = r.ap[c][t];
    }
    double ap = 0;
    for (double a : r.ap[c]) ap += a;
    m["ap_" + name] = ap / static_cast<double>(r.ap[c].size());
    if (c < tp.ate.size()) {
      m["ate_" + name] = tp.ate[c];
      m["ase_" + name] = tp.ase[c];
      m["aoe_" + name] = tp.aoe[c];
      m["ave_" + name] = tp.ave[c];
    }
  }
  m["ate"] = tp.mate;
  m["ase"] = tp.mase;
  m["aoe"] = tp.maoe;
  m["ave"] = tp.mave;
  m["aae"] = tp.maae;
  const DetectionScore s = detection_score(r.map, tp);
  m["nds"] = s.nds;
  m["nds_no_aae"] = s.nds_no_aae;
}

}  // namespace parallax::data
