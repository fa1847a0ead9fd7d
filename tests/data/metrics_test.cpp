// BEV IoU, nuScenes-style detection AP, the true-positive errors (ATE, ASE, AOE, AVE, AAE) and NDS
// against hand-computed values.
#include "data/metrics.h"
#include "core/error.h"
#include "data/detection_score.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace parallax::data {
namespace {

// AP in double: numpy.interp at 101 recall points (a slope, a product and a sum per point, values
// <= 1), the sum of at most 101 of them, two divisions: within 8 u64 of exact (each term 4
// roundings of <= 1, the sum 101 more, over the 90 points averaged); numpy's value for the
// literal likewise, and its decimal print 1 more; a mean of up to 12 APs 12 more. 64 u64 covers
// all.
constexpr double kApTol = 64 * 0x1p-53;

TEST(BevIouTest, HandMadeLabelMaps) {
  // Classes 0..2 on a 2 x 4 map, two samples.
  const at::Tensor target =
      at::tensor({0, 1, 1, 2, 2, 2, 0, 0, /**/ 1, 1, 1, 1, 0, 0, 2, 2}, at::kLong)
          .reshape({2, 2, 4});
  const at::Tensor pred =
      at::tensor({0, 1, 2, 2, 2, 0, 0, 1, /**/ 1, 1, 0, 0, 0, 2, 2, 2}, at::kLong)
          .reshape({2, 2, 4});
  BevIouMetric m(3);
  m.update(pred.slice(0, 0, 1), target.slice(0, 0, 1));
  m.update(pred.slice(0, 1, 2), target.slice(0, 1, 2));
  // class 0: target cells {0,6,7 | 12,13}, pred {0,5,6 | 10,11,12}: inter {0,6,12} = 3, union 8.
  // class 1: target {1,2 | 8,9,10,11}, pred {1,7 | 8,9}: inter {1,8,9} = 3, union 7.
  // class 2: target {3,4,5 | 14,15}, pred {2,3,4 | 13,14,15}: inter {3,4,14,15} = 4, union 7.
  const auto iou = m.iou();
  // Exact: each IoU is one division of integer counts, as the expected expression; the mean sums
  // the same values in the same order and divides by the same count.
  EXPECT_EQ(iou[0], 3.0 / 8);
  EXPECT_EQ(iou[1], 3.0 / 7);
  EXPECT_EQ(iou[2], 4.0 / 7);
  EXPECT_EQ(m.miou(), (3.0 / 7 + 4.0 / 7) / 2);  // background excluded
  // Counts round-trip (the distributed path sums them across ranks).
  BevIouMetric n(3);
  n.set_counts(m.counts() * 2);
  EXPECT_EQ(n.iou()[1], 3.0 / 7);
}

TEST(BevIouTest, AbsentClassIsNanAndSkippedInMean) {
  BevIouMetric m(4);
  const at::Tensor t = at::tensor({0, 1, 1, 0}, at::kLong).reshape({1, 2, 2});
  m.update(t, t);
  EXPECT_EQ(m.iou()[1], 1.0);  // n / n
  EXPECT_TRUE(std::isnan(m.iou()[3]));
  EXPECT_EQ(m.miou(), 1.0);
  EXPECT_THROW(m.update(t, t.reshape({1, 4})), Error);
}

// Builds [1, K, 9] boxes of class `cls` at the given (x, y) centres.
at::Tensor boxes_at(const std::vector<std::pair<double, double>>& xy, std::vector<int> cls,
                    float vis = 1) {
  at::Tensor b = at::zeros({1, static_cast<int64_t>(xy.size()), 9}, at::kFloat);
  for (size_t i = 0; i < xy.size(); ++i) {
    b[0][static_cast<int64_t>(i)][0] = xy[i].first;
    b[0][static_cast<int64_t>(i)][1] = xy[i].second;
    b[0][static_cast<int64_t>(i)][3] = 4;
    b[0][static_cast<int64_t>(i)][7] = cls[i];
    b[0][static_cast<int64_t>(i)][8] = vis;
  }
  return b;
}

at::Tensor ids(int64_t i) {
  return at::tensor({i}, at::kLong);
}

TEST(DetectionApTest, PerfectDetectionsGiveApOne) {
  at::manual_seed(5);
  DetectionApMetric m(3);
  for (int64_t s = 0; s < 4; ++s) {
    const at::Tensor xy = at::rand({6, 2}, at::kDouble) * 50 - 25;
    std::vector<std::pair<double, double>> pts;
    for (int i = 0; i < 6; ++i) pts.emplace_back(xy[i][0].item<double>(), xy[i][1].item<double>());
    const at::Tensor gt = boxes_at(pts, {0, 1, 2, 0, 1, 2});
    m.update(gt, at::rand({1, 6}), gt, ids(s));
  }
  const auto r = m.compute();
  for (const auto& per_class : r.ap) {
    for (double ap : per_class) EXPECT_NEAR(ap, 1.0, kApTol);
  }
  EXPECT_NEAR(r.map, 1.0, kApTol);
  EXPECT_EQ(r.num_gt, (std::vector<int64_t>{8, 8, 8}));
}

TEST(DetectionApTest, HandComputedSmallCase) {
  // Two ground-truth boxes; detections by score: hit, miss (far away), hit.
  // TP = [1, 0, 1] -> precision [1, 1/2, 2/3], recall [1/2, 1/2, 1]. Interpolated at r = 0.11..1:
  // r < 0.5: 1; r = 0.5: 1/2 (the last point at that recall); 0.5 < r <= 1: 1/2 + (r - 1/2) / 3.
  // AP = (39 * 1 + sum_{i=50..100} (p_i - 0.1) / 0.9) / 90 = 0.7376543209876...
  // (cross-checked with the nuScenes devkit formula in numpy).
  DetectionApMetric m(1, {2.0});
  const at::Tensor gt = boxes_at({{10, 0}, {-10, 5}}, {0, 0});
  const at::Tensor det = boxes_at({{10.5, 0}, {0, 20}, {-10, 5.5}}, {0, 0, 0});
  m.update(det, at::tensor({0.9f, 0.8f, 0.7f}).reshape({1, 3}), gt, ids(0));
  const auto r = m.compute();
  EXPECT_NEAR(r.ap[0][0], 0.7376543209876544, kApTol);
  EXPECT_NEAR(average_precision({true, false, true}, 2), 0.7376543209876544, kApTol);
  // Only misses, or no ground truth: AP 0.
  EXPECT_EQ(average_precision({false, false}, 3), 0.0);
  EXPECT_EQ(average_precision({true}, 0), 0.0);
  // Recall never above 0.1 gives 0 too: one hit out of 20.
  EXPECT_EQ(average_precision({true}, 20), 0.0);
}

TEST(DetectionApTest, ThresholdsBehave) {
  // One detection 1.5 m away from the only ground truth: a match at 2 and 4 m, not at 0.5 or 1 m.
  DetectionApMetric m(1);
  m.update(boxes_at({{3.0, 1.5}}, {0}), at::tensor({0.8f}).reshape({1, 1}),
           boxes_at({{3.0, 0.0}}, {0}), ids(0));
  const auto r = m.compute();
  ASSERT_EQ(r.thresholds, (std::vector<double>{0.5, 1.0, 2.0, 4.0}));
  EXPECT_EQ(r.ap[0][0], 0.0);
  EXPECT_EQ(r.ap[0][1], 0.0);
  EXPECT_NEAR(r.ap[0][2], 1.0, kApTol);
  EXPECT_NEAR(r.ap[0][3], 1.0, kApTol);
  EXPECT_NEAR(r.map_at[2], 1.0, kApTol);
  EXPECT_NEAR(r.map, 0.5, kApTol);
}

TEST(DetectionApTest, MatchesOnlyTheSameClassAndSample) {
  DetectionApMetric m(2, {1.0});
  // Sample 0 has a class-0 box at (0, 0); a class-1 detection there and a class-0 detection in
  // sample 1 must not match it.
  m.update(boxes_at({{0, 0}}, {1}), at::tensor({0.9f}).reshape({1, 1}), boxes_at({{0, 0}}, {0}),
           ids(0));
  m.update(boxes_at({{0, 0}}, {0}), at::tensor({0.9f}).reshape({1, 1}), boxes_at({{9, 9}}, {1}),
           ids(1));
  const auto r = m.compute();
  EXPECT_EQ(r.ap[0][0], 0.0);
  EXPECT_EQ(r.ap[1][0], 0.0);
}

TEST(DetectionApTest, IgnoresInvisibleAndPaddedGroundTruth) {
  DetectionApMetric m(1, {1.0});
  at::Tensor gt = boxes_at({{0, 0}, {5, 5}, {9, 9}}, {0, 0, -1});
  gt[0][1][8] = 0;                                               // invisible: ignored
  const at::Tensor det = boxes_at({{0, 0}, {30, 30}}, {0, -1});  // the second row is padding
  m.update(det, at::tensor({0.9f, 0.99f}).reshape({1, 2}), gt, ids(3));
  const auto r = m.compute();
  EXPECT_EQ(r.num_gt[0], 1);
  EXPECT_NEAR(r.ap[0][0], 1.0, kApTol);
}

TEST(DetectionApTest, GreedyMatchingTakesTheNearestUnmatchedBox) {
  // Two GT boxes 1.2 m apart. Detection A (score 0.9) sits 0.5 m from GT1 and 0.7 m from GT2, so
  // it takes GT1; detection B (0.8) sits on GT1, which is taken, so its nearest unmatched box is
  // GT2 at 1.2 m: a miss at 1 m, a hit at 2 m.
  DetectionApMetric m(1, {1.0, 2.0});
  const at::Tensor gt = boxes_at({{0, 0}, {1.2, 0}}, {0, 0});
  const at::Tensor det = boxes_at({{0.5, 0}, {0, 0}}, {0, 0});
  m.update(det, at::tensor({0.9f, 0.8f}).reshape({1, 2}), gt, ids(0));
  const auto r = m.compute();
  EXPECT_NEAR(r.ap[0][0], average_precision({true, false}, 2), kApTol);
  EXPECT_NEAR(r.ap[0][1], 1.0, kApTol);
}

TEST(DetectionApTest, PackAndMergeEqualOneAccumulator) {
  at::manual_seed(11);
  DetectionApMetric all(3), a(3), b(3);
  for (int64_t s = 0; s < 6; ++s) {
    const at::Tensor gt = at::rand({1, 5, 9}) * 10;
    gt.select(2, 7).copy_(at::randint(0, 3, {1, 5}));
    gt.select(2, 8).fill_(1);
    at::Tensor det = gt + at::randn({1, 5, 9}) * 0.8;
    det.select(2, 7).copy_(gt.select(2, 7));
    const at::Tensor sc = at::rand({1, 5});
    all.update(det, sc, gt, ids(s));
    (s % 2 ? a : b).update(det, sc, gt, ids(s));
  }
  DetectionApMetric merged(3);
  merged.merge(b.pack());
  merged.merge(a.pack());
  const auto r1 = all.compute(), r2 = merged.compute();
  EXPECT_EQ(r1.ap, r2.ap);
  EXPECT_GT(r1.map, 0.05);
  EXPECT_LT(r1.map, 0.999);
}

// Two true positives of one class in one sample (recall 0.5 after the first, 1 after the second):
//   first (score 0.9): 1 m off, half the length (IoU 6 / 12 = 0.5), yaw 0.5 rad off;
//   second (score 0.8): exact.
// Running means: ATE [1, 0.5], ASE = AOE [0.5, 0.25]. The confidence at recall x is 0.9 for
// x <= 0.5 and 0.9 - 0.2 (x - 0.5) above, so the interpolated running ATE is 1 at x = 0.11..0.49
// (39 points) and 1.5 - x at x = 0.50..1.00 (51 points, mean 0.75): ATE = (39 + 51 * 0.75) / 90
// = 77.25 / 90; ASE and AOE are half of it. Rounding: ~4 per point (interp: one slope, product,
// sum) on values <= 1.5, 90 sums, one division: within 2^-44, well inside 1e-12.
TEST(DetectionTpErrorsTest, HandComputedTwoTruePositives) {
  const at::Tensor pred = at::tensor({0., 0., 1.,  0., 0., 2., 2., 1.5, 0.5, 0.9, 0.,  //
                                      0., 0., 10., 0., 0., 4., 2., 1.5, 0.,  0.8, 1.},
                                     at::kDouble)
                              .reshape({2, 11});
  const at::Tensor gt = at::tensor({0., 0., 0., 0., 0., 4., 2., 1.5, 0.,  //
                                    0., 0., 10., 0., 0., 4., 2., 1.5, 0.},
                                   at::kDouble)
                            .reshape({2, 9});
  const TpErrors e = detection_tp_errors(pred, gt, {"a", "b"}, 2.0);
  EXPECT_NEAR(e.ate[0], 77.25 / 90, 1e-12);
  EXPECT_NEAR(e.ase[0], 77.25 / 180, 1e-12);
  EXPECT_NEAR(e.aoe[0], 77.25 / 180, 1e-12);
  // Class 1 has neither ground truth nor predictions: error 1 (the devkit's convention), and the
  // means average both classes.
  EXPECT_EQ(e.ate[1], 1.0);
  EXPECT_NEAR(e.mate, (77.25 / 90 + 1) / 2, 1e-12);
  // The 11/9-column forms: the ground truth's velocity is unknown (NaN), so every running mean of
  // AVE is the devkit's all-NaN 1, as AAE's always is.
  EXPECT_EQ(e.ave[0], 1.0);
  EXPECT_EQ(e.aae[0], 1.0);
  // Beyond the threshold the first prediction is a false positive: only the exact one matches,
  // at recall 0.5 after two predictions; its running mean is 0 at every point up to 0.5.
  const at::Tensor far = pred.clone();
  far[0][2] = 3.0;
  const TpErrors f = detection_tp_errors(far, gt, {"a"}, 2.0);
  EXPECT_EQ(f.ate[0], 0.0);
}

TEST(DetectionTpErrorsTest, YawDifferenceWrapsAroundTwoPi) {
  // yaw 3.0 vs -3.0: 6 rad apart one way, 2 pi - 6 = 0.2832 the other.
  const at::Tensor pred =
      at::tensor({0., 0., 0., 0., 0., 4., 2., 1.5, 3.0, 0.9, 0.}, at::kDouble).reshape({1, 11});
  const at::Tensor gt =
      at::tensor({0., 0., 0., 0., 0., 4., 2., 1.5, -3.0}, at::kDouble).reshape({1, 9});
  const TpErrors e = detection_tp_errors(pred, gt, {"a"}, 2.0);
  EXPECT_NEAR(e.aoe[0], 2 * M_PI - 6.0, 1e-12);
  EXPECT_EQ(e.ate[0], 0.0);
  EXPECT_EQ(e.ase[0], 0.0);
}

// The devkit's cummean: NaN skipped, 0 before the first number, all NaN gives ones; nanmean.
TEST(DetectionTpErrorsTest, NanAwareRunningMeanAndNanMean) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(nan_cummean({nan, 2.0, nan, 4.0}), (std::vector<double>{0.0, 2.0, 2.0, 3.0}));
  EXPECT_EQ(nan_cummean({nan, nan}), (std::vector<double>{1.0, 1.0}));
  EXPECT_EQ(nan_cummean({1.0, 2.0}), (std::vector<double>{1.0, 1.5}));
  EXPECT_EQ(nan_mean({nan, 1.0, 2.0}), 1.5);
  EXPECT_TRUE(std::isnan(nan_mean({nan, nan})));
}

// The two true positives of HandComputedTwoTruePositives with velocities: the first's ground
// truth has none (NaN), the second's prediction is (3, 4) m/s off (error 5). The devkit's running
// mean is [0, 5] (0 before the first number), against the scores [0.9, 0.8]. At recall x <= 0.5
// the confidence is 0.9: running mean 0 (39 points 0.11 .. 0.49); above, the confidence
// 0.9 - 0.2 (x - 0.5) interpolates the running mean to 10 (x - 0.5), mean 2.5 over the 51 points
// 0.50 .. 1.00. AVE = 51 * 2.5 / 90. Rounding as in HandComputedTwoTruePositives (values <= 5):
// far inside 1e-12. A running mean that skipped the leading NaN instead (5 throughout) would give
// 5, one with NaN would give NaN: this test tells them apart.
TEST(DetectionTpErrorsTest, VelocityErrorSkipsUnknownGroundTruthAsTheDevkit) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const at::Tensor pred = at::tensor({0., 0., 1.,  0., 0., 2., 2., 1.5, 0.5, 0.9, 0., 7.0, -1.0,  //
                                      0., 0., 10., 0., 0., 4., 2., 1.5, 0.,  0.8, 1., 4.0, 6.0},
                                     at::kDouble)
                              .reshape({2, kTpPredColumns});
  const at::Tensor gt = at::tensor({0., 0., 0.,  0., 0., 4., 2., 1.5, 0., nan, nan,  //
                                    0., 0., 10., 0., 0., 4., 2., 1.5, 0., 1.0, 2.0},
                                   at::kDouble)
                            .reshape({2, kTpGtColumns});
  const TpErrors e = detection_tp_errors(pred, gt, {"car"}, 2.0);
  EXPECT_NEAR(e.ave[0], 51 * 2.5 / 90, 1e-12);
  EXPECT_NEAR(e.ate[0], 77.25 / 90, 1e-12);  // the velocity columns change nothing else
  EXPECT_EQ(e.aae[0], 1.0);                  // no attribute: the devkit's all-NaN 1
  EXPECT_NEAR(e.mave, e.ave[0], 0.0);
  // Both ground-truth velocities unknown: AVE 1 (all NaN), whatever the predictions say.
  const at::Tensor unknown = gt.clone();
  unknown.narrow(1, 9, 2).fill_(nan);
  EXPECT_EQ(detection_tp_errors(pred, unknown, {"car"}, 2.0).ave[0], 1.0);
}

// One true positive per class (recall 1 from the first prediction on: every recall point's
// running mean is that match's error, exactly):
//   car: 0.5 m off, yaw 0.3 off, velocity (1, 2) vs (1, 0): ATE 0.5, AOE 0.3, AVE 2;
//   traffic_cone: 0.25 m off, yaw 1 off: ATE 0.25, and no AOE, AVE, AAE (NaN);
//   barrier: yaw pi - 0.1 off, which its period pi makes 0.1: ATE 0, AOE 0.1, no AVE, AAE.
// Means skip NaN: ATE (0.5 + 0.25 + 0) / 3, AOE (0.3 + 0.1) / 2, AVE 2 and AAE 1 (car alone).
TEST(DetectionTpErrorsTest, ClassExceptionsByNameAndNanMeans) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double pi = 3.14159265358979323846;
  const at::Tensor pred = at::tensor({0., 0., 0.5, 0.,   0., 4., 2., 1.5, 0.3,     0.9, 0., 1., 2.,
                                      0., 1., 10., 0.25, 0., .3, .3, .7,  1.0,     0.8, 1., 0., 0.,
                                      0., 2., 20., 0.,   0., 2., .5, 1.,  pi - .1, 0.7, 2., 0., 0.},
                                     at::kDouble)
                              .reshape({3, kTpPredColumns});
  const at::Tensor gt = at::tensor({0., 0., 0.,  0., 0., 4., 2., 1.5, 0., 1.,  0.,   //
                                    0., 1., 10., 0., 0., .3, .3, .7,  0., nan, nan,  //
                                    0., 2., 20., 0., 0., 2., .5, 1.,  0., 0.,  0.},
                                   at::kDouble)
                            .reshape({3, kTpGtColumns});
  const TpErrors e = detection_tp_errors(pred, gt, {"car", "traffic_cone", "barrier"}, 2.0);
  // Each error is one subtraction, hypot or fmod of values <= 20: within 1e-14; 1e-12 is margin.
  EXPECT_NEAR(e.ate[0], 0.5, 1e-12);
  EXPECT_NEAR(e.aoe[0], 0.3, 1e-12);
  EXPECT_NEAR(e.ave[0], 2.0, 1e-12);
  EXPECT_EQ(e.aae[0], 1.0);
  EXPECT_NEAR(e.ate[1], 0.25, 1e-12);
  EXPECT_TRUE(std::isnan(e.aoe[1]) && std::isnan(e.ave[1]) && std::isnan(e.aae[1]));
  EXPECT_EQ(e.ate[2], 0.0);
  EXPECT_NEAR(e.aoe[2], 0.1, 1e-12);  // period 2 pi would give pi - 0.1
  EXPECT_TRUE(std::isnan(e.ave[2]) && std::isnan(e.aae[2]));
  EXPECT_NEAR(e.mate, 0.75 / 3, 1e-12);
  EXPECT_NEAR(e.maoe, 0.2, 1e-12);
  EXPECT_NEAR(e.mave, 2.0, 1e-12);
  EXPECT_EQ(e.maae, 1.0);
  EXPECT_EQ(e.mase, 0.0);
  // The same boxes under names without exceptions: every error counts, yaw period 2 pi.
  const TpErrors plain = detection_tp_errors(pred, gt, {"a", "b", "c"}, 2.0);
  EXPECT_NEAR(plain.aoe[2], pi - 0.1, 1e-12);
  EXPECT_NEAR(plain.aoe[1], 1.0, 1e-12);
  EXPECT_EQ(plain.ave[1], 1.0);  // NaN ground truth: all-NaN running mean
  EXPECT_NEAR(plain.ave[2], 0.0, 0.0);
}

// NDS = (5 mAP + sum of max(1 - err, 0)) / 10 and without AAE / 9; a NaN mean scores 0.
// mAP 0.6 and errors ATE 0.25, ASE 0, AOE 0.2, AVE 2 (clipped to score 0), AAE 1: the scores
// sum to 0.75 + 1 + 0.8 + 0 + 0 = 2.55, NDS = 5.55 / 10, NDS without AAE = 5.55 / 9. A handful of
// roundings of values <= 5.55: 1e-14; 1e-12 is margin.
TEST(DetectionTpErrorsTest, DetectionScoreIsTheDevkitFormula) {
  TpErrors tp;
  tp.mate = 0.25, tp.mase = 0.0, tp.maoe = 0.2, tp.mave = 2.0, tp.maae = 1.0;
  const DetectionScore s = detection_score(0.6, tp);
  EXPECT_NEAR(s.nds, 0.555, 1e-12);
  EXPECT_NEAR(s.nds_no_aae, 5.55 / 9, 1e-12);
  tp.mave = std::numeric_limits<double>::quiet_NaN();  // every class exempt: score 0, as 2 gives
  EXPECT_NEAR(detection_score(0.6, tp).nds, 0.555, 1e-12);
  tp.maae = 0.5;  // the attribute term moves NDS only
  EXPECT_NEAR(detection_score(0.6, tp).nds, 0.605, 1e-12);
  EXPECT_NEAR(detection_score(0.6, tp).nds_no_aae, 5.55 / 9, 1e-12);
  // The keys eval reports, from the same numbers.
  DetectionResult r;
  r.thresholds = {0.5, 1.0, 2.0, 4.0};
  r.ap = {{0.2, 0.4, 0.8, 1.0}};
  r.map_at = {0.2, 0.4, 0.8, 1.0};
  r.map = 0.6;
  tp.ate = {0.25}, tp.ase = {0.0}, tp.aoe = {0.2}, tp.ave = {2.0}, tp.aae = {0.5};
  std::map<std::string, double> m;
  add_detection_metrics(r, tp, {"car"}, m);
  EXPECT_NEAR(m.at("ap_car"), 0.6, 1e-15);
  EXPECT_EQ(m.at("ap_2m_car"), 0.8);
  EXPECT_EQ(m.at("ave_car"), 2.0);
  EXPECT_EQ(m.at("nds"), detection_score(0.6, tp).nds);
  EXPECT_EQ(m.at("nds_no_aae"), detection_score(0.6, tp).nds_no_aae);
  for (const char* k : {"map", "map_0.5m", "map_1m", "map_2m", "map_4m", "ate", "ase", "aoe", "ave",
                        "aae", "ate_car", "ase_car", "aoe_car"})
    EXPECT_TRUE(m.count(k)) << k;
}

}  // namespace
}  // namespace parallax::data
