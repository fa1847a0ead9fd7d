// train::append_eval_rows: the rows eval scores (EvalDetections, data/detection_score.h) from a
// postprocessed output and a batch, with the velocity contract of the loader and the models:
// `velocities` / `det_velocities` carried row for row beside their boxes, and when absent NaN
// (ground truth: unknown) and (0, 0) (predictions: what the submission then says).
#include "core/error.h"
#include "data/detection_score.h"
#include "train/evaluate.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace parallax::train {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

// Two samples (scene ids 7 and 3), two detections and three ground-truth rows each:
//   detections: sample 7 class 1, class -1 (no detection); sample 3 class 0, class 5 (beyond the
//   3 classes);
//   ground truth: sample 7 class 2 visible, class 0 invisible, padding (class -1); sample 3 class 1
//   visible, padding, padding.
// Values are float32-exact, so rows compare exactly.
struct Case {
  core::TensorDict post, batch;
};

Case make_case() {
  Case c;
  at::Tensor det = at::zeros({2, 2, 9}, at::kFloat);
  det[0][0] = at::tensor({1.5f, -2.f, 0.5f, 4.f, 2.f, 1.5f, 0.25f, 1.f, 1.f});
  det[0][1] = at::tensor({0.f, 0.f, 0.f, 1.f, 1.f, 1.f, 0.f, -1.f, 0.f});
  det[1][0] = at::tensor({-3.f, 6.f, 1.f, 0.5f, 0.5f, 1.75f, -1.f, 0.f, 1.f});
  det[1][1] = at::tensor({9.f, 9.f, 0.f, 1.f, 1.f, 1.f, 0.f, 5.f, 1.f});
  c.post["det_boxes"] = det;
  c.post["det_scores"] = at::tensor({0.75f, 0.5f, 0.875f, 0.25f}).reshape({2, 2});
  at::Tensor gt = at::zeros({2, 3, 9}, at::kFloat);
  gt[0][0] = at::tensor({1.f, -2.f, 0.5f, 4.f, 2.f, 1.5f, 0.f, 2.f, 0.7f});
  gt[0][1] = at::tensor({5.f, 5.f, 0.f, 4.f, 2.f, 1.5f, 0.f, 0.f, 0.f});
  gt[0][2] = at::tensor({0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, -1.f, 0.f});
  gt[1][0] = at::tensor({-3.f, 6.5f, 1.f, 0.5f, 0.5f, 1.75f, 0.5f, 1.f, 0.9f});
  gt[1][1] = gt[0][2];
  gt[1][2] = gt[0][2];
  c.batch["boxes"] = gt;
  c.batch["scene_index"] = at::tensor({7, 3}, at::kLong);
  return c;
}

void expect_rows(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << "element " << i << ": " << got[i];
    } else {
      EXPECT_EQ(got[i], want[i]) << "element " << i;
    }
  }
}

TEST(EvalRowsTest, VelocitiesTravelRowForRowBesideTheirBoxes) {
  Case c = make_case();
  at::Tensor dv = at::full({2, 2, 2}, 99.f);  // rows left out must not leak their velocity
  dv[0][0] = at::tensor({2.5f, -0.5f});
  dv[1][0] = at::tensor({0.f, 1.25f});
  c.post["det_velocities"] = dv;
  at::Tensor gv = at::full({2, 3, 2}, static_cast<float>(kNan));
  gv[0][0] = at::tensor({3.f, -1.f});
  gv[0][1] = at::tensor({7.f, 7.f});  // invisible: left out
  // sample 3's visible box keeps NaN: unknown
  c.batch["velocities"] = gv;
  std::vector<double> pred, gt;
  append_eval_rows(c.post, c.batch, 3, pred, gt);
  expect_rows(pred, {7, 1, 1.5, -2, 0.5, 4,   2,   1.5,  0.25, 0.75,  0, 2.5, -0.5,  //
                     3, 0, -3,  6,  1,   0.5, 0.5, 1.75, -1,   0.875, 0, 0,   1.25});
  expect_rows(gt, {7, 2, 1,  -2,  0.5, 4,   2,   1.5,  0,   3,    -1,  //
                   3, 1, -3, 6.5, 1,   0.5, 0.5, 1.75, 0.5, kNan, kNan});
  EXPECT_EQ(pred.size() % data::kTpPredColumns, 0u);
  EXPECT_EQ(gt.size() % data::kTpGtColumns, 0u);
}

TEST(EvalRowsTest, AbsentVelocitiesAreZeroForPredictionsAndUnknownForGroundTruth) {
  Case c = make_case();
  std::vector<double> pred, gt;
  append_eval_rows(c.post, c.batch, 3, pred, gt);
  expect_rows(pred, {7, 1, 1.5, -2, 0.5, 4,   2,   1.5,  0.25, 0.75,  0, 0, 0,  //
                     3, 0, -3,  6,  1,   0.5, 0.5, 1.75, -1,   0.875, 0, 0, 0});
  expect_rows(gt, {7, 2, 1,  -2,  0.5, 4,   2,   1.5,  0,   kNan, kNan,  //
                   3, 1, -3, 6.5, 1,   0.5, 0.5, 1.75, 0.5, kNan, kNan});
}

TEST(EvalRowsTest, AVelocityTensorNotBesideItsBoxesIsRefusedNamingIt) {
  Case c = make_case();
  c.batch["velocities"] = at::zeros({2, 2, 2});  // 2 rows where the boxes have 3
  std::vector<double> pred, gt;
  try {
    append_eval_rows(c.post, c.batch, 3, pred, gt);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'velocities' must be [2, 3, 2]"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace parallax::train
