// Evaluation metrics of docs/data.md, accumulated over batches and computed at the end.
//
// BevIouMetric: per-class intersection and union summed over every cell of every sample; IoU per
// class (NaN where a class never occurs in prediction or target) and mIoU over the non-background
// classes (index >= 1) that occur.
//
// DetectionApMetric: nuScenes-style detection AP by BEV centre distance, as the nuScenes devkit
// computes it (nuscenes/eval/detection/algo.py, min_recall = min_precision = 0.1): per class and
// threshold d, predictions of all samples sorted by descending score (ties: lower sample id, then
// lower row) are matched greedily to the nearest not yet matched ground-truth box of that class in
// the same sample; a match closer than d (strictly) is a true positive, anything else a false
// positive. Precision p_i = TP_i / (TP_i + FP_i) and recall r_i = TP_i / N_gt are resampled at the
// 101 recall points 0, 0.01, ..., 1 by linear interpolation (numpy.interp semantics: precision 0
// beyond the highest recall reached); AP = mean over the recall points above 0.1 (r = 0.11 ... 1)
// of max(p - 0.1, 0) / 0.9. A class without predictions, or without ground truth, has AP 0 (the
// devkit's convention). mAP averages over classes and thresholds; mAP@d over classes at d.
// Ground-truth rows with visibility 0 and rows with class -1 (padding) are ignored, as are
// prediction rows with class -1.
//
// Distributed evaluation: each rank accumulates its own samples, keyed by the global scene index;
// `pack()` gives the accumulated rows as tensors to all-gather, and `merge()` adds another rank's.
// Not thread-safe.
#pragma once

#include "core/tensor_dict.h"

#include <cstdint>
#include <string>
#include <vector>

namespace parallax::data {

class BevIouMetric {
 public:
  explicit BevIouMetric(int64_t num_classes);

  // `pred` and `target`: integer class maps of the same shape ([B, X, Y]).
  void update(const at::Tensor& pred, const at::Tensor& target);
  std::vector<double> iou() const;
  double miou() const;
  // int64 [2, C]: intersection and union counts (to all-reduce with a sum, then `set_counts`).
  at::Tensor counts() const;
  void set_counts(const at::Tensor& counts);
  void reset();

 private:
  int64_t num_classes_;
  std::vector<int64_t> inter_, uni_;
};

struct DetectionResult {
  std::vector<double> thresholds;
  std::vector<std::vector<double>> ap;  // [class][threshold]
  std::vector<double> map_at;           // per threshold, averaged over classes
  double map = 0;                       // over classes and thresholds
  std::vector<int64_t> num_gt;          // per class, counted boxes
};

class DetectionApMetric {
 public:
  explicit DetectionApMetric(int64_t num_classes,
                             std::vector<double> thresholds = {0.5, 1.0, 2.0, 4.0});

  // det_boxes float [B, K, 9] (class column 7), det_scores float [B, K], gt_boxes float [B, G, 9]
  // (visibility column 8), sample_ids int64 [B] (global scene indices: unique across ranks).
  void update(const at::Tensor& det_boxes, const at::Tensor& det_scores, const at::Tensor& gt_boxes,
              const at::Tensor& sample_ids);
  DetectionResult compute() const;

  // {"pred": float64 [P, 6] (sample, class, x, y, score, row), "gt": float64 [G, 4] (sample,
  // class, x, y)}.
  core::TensorDict pack() const;
  void merge(const core::TensorDict& packed);
  void reset();

 private:
  struct Pred {
    int64_t sample, cls;
    double x, y, score;
    int64_t order;  // row within its sample's detections, for deterministic tie-breaking
  };
  struct Gt {
    int64_t sample, cls;
    double x, y;
  };
  int64_t num_classes_;
  std::vector<double> thresholds_;
  std::vector<Pred> preds_;
  std::vector<Gt> gts_;
};

// The true-positive errors (ATE, ASE, AOE, AVE, AAE) and NDS: data/detection_score.h.

// numpy.interp(x, xp, fp, left, right) for a non-decreasing, non-empty `xp` (duplicates allowed:
// the last xp equal to x wins) (exposed for tests).
double interp(double x, const std::vector<double>& xp, const std::vector<double>& fp, double left,
              double right);

// The devkit's AP from a match list sorted by descending score (`tp[i]` true for a true positive)
// and the ground-truth count (exposed for tests).
double average_precision(const std::vector<bool>& tp, int64_t num_gt, double min_recall = 0.1,
                         double min_precision = 0.1);

}  // namespace parallax::data
