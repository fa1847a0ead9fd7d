// The nuScenes detection score's parts beyond AP (data/metrics.h): the true-positive errors ATE,
// ASE, AOE, AVE, AAE and NDS, as nuscenes-devkit computes them (detection/algo.py `accumulate`
// and `calc_tp`, detection/evaluate.py's class exceptions, detection/data_classes.py
// `DetectionMetrics`), and the metric keys that `parallax eval` and the trainer's eval report
// (docs/data.md, "Metrics").
//
// Errors at one centre-distance threshold (the devkit's `dist_th_tp`, 2 m). Predictions are
// matched exactly as DetectionApMetric matches them at that threshold; for each true positive:
//   ATE = BEV centre distance (x, y) in metres;
//   ASE = 1 - IoU of the two boxes after aligning centres and headings: prod(min(l, w, h)) over
//         vol_gt + vol_pred - prod(min(l, w, h));
//   AOE = the smallest yaw difference in radians, in [0, pi]: period 2 pi, pi for `barrier`;
//   AVE = |v_pred - v_gt| (x, y) in m/s; NaN where the ground truth's velocity is unknown;
//   AAE = 1 - attribute accuracy: always NaN here. Parallax carries no ground-truth attribute and
//         predicts none; the devkit gives NaN for a ground truth without attribute (the
//         synthetic scenes), so NaN is its value there. (Real nuScenes ground truth has
//         attributes for most boxes, which the devkit would score 1 against our empty
//         attribute_name: our AAE is then 1 too, as the all-NaN case below gives, up to the
//         devkit's few annotations without attribute.)
// Per class, each error's NaN-aware running mean over the true positives in score order (the
// devkit's `cummean`: NaNs are skipped; positions before the first number are 0; all NaN gives
// 1 everywhere) is resampled at the 101 recall points through the confidence (numpy.interp of the
// running mean against the matched scores, at the confidence interpolated at each recall point,
// right = 0), and the error is the mean over the recall points from 0.11 up to the highest recall
// reached. A class with no true positive, no ground truth or a highest recall below 0.11 has
// error 1. By class name, as the devkit: `traffic_cone` has no AOE, AVE, AAE and `barrier` no
// AVE, AAE (NaN). Means over classes skip NaN (numpy.nanmean; NaN where every class is NaN).
//
// NDS (the devkit's `nd_score`): (5 mAP + sum over the 5 mean errors of max(1 - err, 0)) / 10,
// with a NaN mean scoring 0 (Python's max(0.0, nan)). `nds_no_aae` leaves AAE out:
// (5 mAP + the other 4) / 9. Since Parallax predicts no attributes, AAE is 1 and NDS is at most
// 0.9; `nds_no_aae` reaches 1 and is what a velocity-predicting model improves without ever
// predicting attributes.
#pragma once

#include "data/metrics.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace parallax::data {

// Row layouts of detection_tp_errors (train::EvalDetections carries the same):
//   pred [P, 13]: sample, class, x, y, z, l, w, h, yaw, score, row (within its sample), vx, vy;
//   gt   [G, 11]: sample, class, x, y, z, l, w, h, yaw, vx, vy (visible rows only; class >= 0).
// Velocities in m/s in the frame of the positions; a NaN ground-truth velocity is unknown.
// The 11- and 9-column forms without velocities are accepted: predicted velocity (0, 0) (what a
// submission without velocity says) and ground-truth velocity NaN.
inline constexpr int64_t kTpPredColumns = 13;
inline constexpr int64_t kTpGtColumns = 11;

struct TpErrors {
  std::vector<double> ate, ase, aoe, ave, aae;  // per class; NaN where the class is exempt
  double mate = 1, mase = 1, maoe = 1, mave = 1, maae = 1;  // nanmean over classes
};

// `class_names` gives the classes (index = the class column) and their exceptions.
TpErrors detection_tp_errors(const at::Tensor& pred, const at::Tensor& gt,
                             const std::vector<std::string>& class_names, double threshold = 2.0);

struct DetectionScore {
  double nds = 0, nds_no_aae = 0;
};
DetectionScore detection_score(double map, const TpErrors& tp);

// The detection metrics of `r` and `tp` into `m` (docs/data.md): map, map_<d>m, ap_<class> (mean
// over the thresholds), ap_2m_<class>, ate/ase/aoe/ave_<class>, ate, ase, aoe, ave, aae, nds,
// nds_no_aae.
void add_detection_metrics(const DetectionResult& r, const TpErrors& tp,
                           const std::vector<std::string>& class_names,
                           std::map<std::string, double>& m);

// The devkit's `cummean` (nuscenes/eval/common/utils.py) (exposed for tests).
std::vector<double> nan_cummean(const std::vector<double>& x);

// numpy.nanmean: the mean of the non-NaN values, NaN where there is none (exposed for tests).
double nan_mean(const std::vector<double>& v);

}  // namespace parallax::data
