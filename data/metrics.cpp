#include "data/metrics.h"

#include "core/error.h"
#include "data/schema.h"

#include <ATen/ops/bincount.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

namespace parallax::data {

// ---- BEV IoU
// --------------------------------------------------------------------------------------

BevIouMetric::BevIouMetric(int64_t num_classes)
    : num_classes_(num_classes),
      inter_(static_cast<size_t>(num_classes), 0),
      uni_(static_cast<size_t>(num_classes), 0) {
  if (num_classes < 1)
    throw_error<Error>("BevIouMetric: num_classes must be >= 1, got {}", num_classes);
}

void BevIouMetric::update(const at::Tensor& pred_in, const at::Tensor& target_in) {
  if (pred_in.sizes() != target_in.sizes()) {
    throw_error<Error>("BevIouMetric: prediction shape [{}] differs from target shape [{}]",
                       fmt::join(pred_in.sizes(), ", "), fmt::join(target_in.sizes(), ", "));
  }
  const at::Tensor pred = pred_in.to(at::kCPU).to(at::kLong).reshape({-1});
  const at::Tensor target = target_in.to(at::kCPU).to(at::kLong).reshape({-1});
  // Cells whose target is outside [0, C) are ignored; predictions outside count as no class.
  const at::Tensor valid = (target >= 0) & (target < num_classes_);
  const at::Tensor p = pred.masked_select(valid), t = target.masked_select(valid);
  const at::Tensor p_ok = p.masked_select((p >= 0) & (p < num_classes_));
  const at::Tensor hit = t.masked_select(p == t);
  const at::Tensor n_pred = at::bincount(p_ok, {}, num_classes_);
  const at::Tensor n_tgt = at::bincount(t, {}, num_classes_);
  const at::Tensor n_hit = at::bincount(hit, {}, num_classes_);
  for (int64_t c = 0; c < num_classes_; ++c) {
    const int64_t i = n_hit[c].item<int64_t>();
    inter_[static_cast<size_t>(c)] += i;
    uni_[static_cast<size_t>(c)] += n_pred[c].item<int64_t>() + n_tgt[c].item<int64_t>() - i;
  }
}

std::vector<double> BevIouMetric::iou() const {
  std::vector<double> out;
  for (int64_t c = 0; c < num_classes_; ++c) {
    const auto u = uni_[static_cast<size_t>(c)];
    out.push_back(
        u > 0 ? static_cast<double>(inter_[static_cast<size_t>(c)]) / static_cast<double>(u) : NAN);
  }
  return out;
}

double BevIouMetric::miou() const {
  double sum = 0;
  int n = 0;
  const auto v = iou();
  for (size_t c = 1; c < v.size(); ++c) {
    if (!std::isnan(v[c])) {
      sum += v[c];
      ++n;
    }
  }
  return n > 0 ? sum / n : NAN;
}

at::Tensor BevIouMetric::counts() const {
  at::Tensor t = at::empty({2, num_classes_}, at::kLong);
  for (int64_t c = 0; c < num_classes_; ++c) {
    t[0][c] = inter_[static_cast<size_t>(c)];
    t[1][c] = uni_[static_cast<size_t>(c)];
  }
  return t;
}

void BevIouMetric::set_counts(const at::Tensor& counts_in) {
  const at::Tensor t = counts_in.to(at::kCPU).to(at::kLong).contiguous();
  if (t.dim() != 2 || t.size(0) != 2 || t.size(1) != num_classes_) {
    throw_error<Error>("BevIouMetric: counts must be [2, {}], got [{}]", num_classes_,
                       fmt::join(t.sizes(), ", "));
  }
  for (int64_t c = 0; c < num_classes_; ++c) {
    inter_[static_cast<size_t>(c)] = t[0][c].item<int64_t>();
    uni_[static_cast<size_t>(c)] = t[1][c].item<int64_t>();
  }
}

void BevIouMetric::reset() {
  std::fill(inter_.begin(), inter_.end(), 0);
  std::fill(uni_.begin(), uni_.end(), 0);
}

// ---- Detection AP
// ---------------------------------------------------------------------------------

double average_precision(const std::vector<bool>& tp, int64_t num_gt, double min_recall,
                         double min_precision) {
  if (num_gt <= 0) return 0.0;
  const bool any_tp = std::any_of(tp.begin(), tp.end(), [](bool v) { return v; });
  if (!any_tp) return 0.0;
  std::vector<double> prec, rec;
  double ctp = 0, cfp = 0;
  for (bool t : tp) {
    (t ? ctp : cfp) += 1;
    prec.push_back(ctp / (ctp + cfp));
    rec.push_back(ctp / static_cast<double>(num_gt));
  }
  // numpy.interp(x, rec, prec, right=0) at x = linspace(0, 1, 101).
  constexpr int kPoints = 101;
  std::vector<double> p(kPoints);
  for (int i = 0; i < kPoints; ++i) {
    const double x = i == kPoints - 1 ? 1.0 : i * 0.01;
    if (x > rec.back()) {
      p[static_cast<size_t>(i)] = 0.0;
      continue;
    }
    if (x < rec.front()) {
      p[static_cast<size_t>(i)] = prec.front();
      continue;
    }
    const auto j =
        static_cast<size_t>(std::upper_bound(rec.begin(), rec.end(), x) - rec.begin()) - 1;
    if (j + 1 == rec.size() || rec[j] == x) {
      p[static_cast<size_t>(i)] = prec[j];
    } else {
      const double slope = (prec[j + 1] - prec[j]) / (rec[j + 1] - rec[j]);
      p[static_cast<size_t>(i)] = slope * (x - rec[j]) + prec[j];
    }
  }
  // Recall points strictly above min_recall (the devkit's `round(100 * min_recall) + 1`).
  const int first = static_cast<int>(std::lround(100 * min_recall)) + 1;
  double sum = 0;
  for (int i = first; i < kPoints; ++i)
    sum += std::max(p[static_cast<size_t>(i)] - min_precision, 0.0);
  return sum / (kPoints - first) / (1.0 - min_precision);
}

DetectionApMetric::DetectionApMetric(int64_t num_classes, std::vector<double> thresholds)
    : num_classes_(num_classes), thresholds_(std::move(thresholds)) {
  if (num_classes < 1 || thresholds_.empty()) {
    throw_error<Error>("DetectionApMetric: needs >= 1 class and >= 1 threshold");
  }
}

void DetectionApMetric::update(const at::Tensor& det_in, const at::Tensor& scores_in,
                               const at::Tensor& gt_in, const at::Tensor& ids_in) {
  const at::Tensor det = det_in.to(at::kCPU).to(at::kDouble).contiguous();
  const at::Tensor scores = scores_in.to(at::kCPU).to(at::kDouble).contiguous();
  const at::Tensor gt = gt_in.to(at::kCPU).to(at::kDouble).contiguous();
  const at::Tensor ids = ids_in.to(at::kCPU).to(at::kLong).contiguous();
  const int64_t B = ids.size(0);
  if (det.dim() != 3 || det.size(0) != B || det.size(2) < kBoxColumns - 1 || scores.dim() != 2 ||
      scores.size(0) != B || scores.size(1) != det.size(1) || gt.dim() != 3 || gt.size(0) != B ||
      gt.size(2) != kBoxColumns) {
    throw_error<Error>(
        "DetectionApMetric: expected det_boxes [B, K, 9], det_scores [B, K], gt_boxes [B, G, 9] "
        "and "
        "sample_ids [B]; got [{}], [{}], [{}], [{}]",
        fmt::join(det.sizes(), ", "), fmt::join(scores.sizes(), ", "), fmt::join(gt.sizes(), ", "),
        fmt::join(ids.sizes(), ", "));
  }
  const int64_t K = det.size(1), G = gt.size(1), Cd = det.size(2);
  const double* d = det.data_ptr<double>();
  const double* s = scores.data_ptr<double>();
  const double* g = gt.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t sample = ids.data_ptr<int64_t>()[b];
    for (int64_t k = 0; k < K; ++k) {
      const double* row = d + (b * K + k) * Cd;
      const auto cls = static_cast<int64_t>(std::lround(row[kBoxClass]));
      if (cls < 0 || cls >= num_classes_) continue;
      preds_.push_back({sample, cls, row[kBoxX], row[kBoxY], s[b * K + k], k});
    }
    for (int64_t k = 0; k < G; ++k) {
      const double* row = g + (b * G + k) * kBoxColumns;
      const auto cls = static_cast<int64_t>(std::lround(row[kBoxClass]));
      if (cls < 0 || cls >= num_classes_ || !(row[kBoxVisibility] > 0)) continue;
      gts_.push_back({sample, cls, row[kBoxX], row[kBoxY]});
    }
  }
}

DetectionResult DetectionApMetric::compute() const {
  DetectionResult r;
  r.thresholds = thresholds_;
  r.map_at.assign(thresholds_.size(), 0.0);
  double total = 0;
  for (int64_t c = 0; c < num_classes_; ++c) {
    std::map<int64_t, std::vector<const Gt*>> gt_by_sample;
    int64_t npos = 0;
    for (const auto& g : gts_) {
      if (g.cls == c) {
        gt_by_sample[g.sample].push_back(&g);
        ++npos;
      }
    }
    std::vector<const Pred*> preds;
    for (const auto& p : preds_) {
      if (p.cls == c) preds.push_back(&p);
    }
    std::stable_sort(preds.begin(), preds.end(), [](const Pred* a, const Pred* b) {
      if (a->score != b->score) return a->score > b->score;
      if (a->sample != b->sample) return a->sample < b->sample;
      return a->order < b->order;
    });
    r.num_gt.push_back(npos);
    std::vector<double> aps;
    for (size_t ti = 0; ti < thresholds_.size(); ++ti) {
      std::map<int64_t, std::vector<bool>> taken;
      std::vector<bool> tp;
      tp.reserve(preds.size());
      for (const Pred* p : preds) {
        const auto it = gt_by_sample.find(p->sample);
        double best = std::numeric_limits<double>::infinity();
        int64_t best_i = -1;
        if (it != gt_by_sample.end()) {
          auto& tk = taken[p->sample];
          tk.resize(it->second.size(), false);
          for (size_t i = 0; i < it->second.size(); ++i) {
            if (tk[i]) continue;
            const double dist = std::hypot(it->second[i]->x - p->x, it->second[i]->y - p->y);
            if (dist < best) {
              best = dist;
              best_i = static_cast<int64_t>(i);
            }
          }
        }
        const bool match = best < thresholds_[ti];
        if (match) taken[p->sample][static_cast<size_t>(best_i)] = true;
        tp.push_back(match);
      }
      const double ap = average_precision(tp, npos);
      aps.push_back(ap);
      r.map_at[ti] += ap / static_cast<double>(num_classes_);
      total += ap;
    }
    r.ap.push_back(aps);
  }
  r.map = total / static_cast<double>(num_classes_ * static_cast<int64_t>(thresholds_.size()));
  return r;
}

core::TensorDict DetectionApMetric::pack() const {
  at::Tensor p = at::empty({static_cast<int64_t>(preds_.size()), 6}, at::kDouble);
  at::Tensor g = at::empty({static_cast<int64_t>(gts_.size()), 4}, at::kDouble);
  double* pp = p.data_ptr<double>();
  for (size_t i = 0; i < preds_.size(); ++i) {
    const auto& x = preds_[i];
    const double row[6] = {
        static_cast<double>(x.sample), static_cast<double>(x.cls), x.x, x.y, x.score,
        static_cast<double>(x.order)};
    std::copy(row, row + 6, pp + i * 6);
  }
  double* gp = g.data_ptr<double>();
  for (size_t i = 0; i < gts_.size(); ++i) {
    const auto& x = gts_[i];
    const double row[4] = {static_cast<double>(x.sample), static_cast<double>(x.cls), x.x, x.y};
    std::copy(row, row + 4, gp + i * 4);
  }
  return {{"pred", p}, {"gt", g}};
}

void DetectionApMetric::merge(const core::TensorDict& packed) {
  const at::Tensor p = packed.at("pred").to(at::kCPU).to(at::kDouble).contiguous();
  const at::Tensor g = packed.at("gt").to(at::kCPU).to(at::kDouble).contiguous();
  if (p.dim() != 2 || p.size(1) != 6 || g.dim() != 2 || g.size(1) != 4) {
    throw_error<Error>("DetectionApMetric::merge: expected pred [P, 6] and gt [G, 4]");
  }
  const double* pp = p.data_ptr<double>();
  for (int64_t i = 0; i < p.size(0); ++i) {
    const double* r = pp + i * 6;
    preds_.push_back({static_cast<int64_t>(r[0]), static_cast<int64_t>(r[1]), r[2], r[3], r[4],
                      static_cast<int64_t>(r[5])});
  }
  const double* gp = g.data_ptr<double>();
  for (int64_t i = 0; i < g.size(0); ++i) {
    const double* r = gp + i * 4;
    gts_.push_back({static_cast<int64_t>(r[0]), static_cast<int64_t>(r[1]), r[2], r[3]});
  }
}

void DetectionApMetric::reset() {
  preds_.clear();
  gts_.clear();
}

// ---- numpy.interp ----------------------------------------------------------------------------

double interp(double x, const std::vector<double>& xp, const std::vector<double>& fp, double left,
              double right) {
  if (x < xp.front()) return left;
  if (x > xp.back()) return right;
  const auto j = static_cast<size_t>(std::upper_bound(xp.begin(), xp.end(), x) - xp.begin()) - 1;
  if (j + 1 == xp.size() || xp[j] == x) return fp[j];
  const double slope = (fp[j + 1] - fp[j]) / (xp[j + 1] - xp[j]);
  return slope * (x - xp[j]) + fp[j];
}

}  // namespace parallax::data
