// launch::submission_json, the files of `parallax eval --dump-predictions`: velocities rotated
// into the global frame with the positions, an unknown one written `NaN` (what the devkit's
// json.load reads), a prediction without velocity columns (0, 0).
#include "launch/submission.h"
#include "core/error.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace parallax::launch {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

// Sample 0 has no pose (ego frame); sample 1's ego frame is turned 90 degrees about z and moved
// by (100, 200, 1): the matrix is written exactly, so every rotated value is exact
// ((x, y) -> (-y, x)) and the strings compare exactly.
std::vector<data::SampleMeta> samples() {
  std::vector<data::SampleMeta> s(2);
  s[0].token = "";
  s[1].token = "tok1";
  s[1].ego_to_global =
      at::tensor({0., -1., 0., 100., 1., 0., 0., 200., 0., 0., 1., 1., 0., 0., 0., 1.}, at::kDouble)
          .reshape({4, 4});
  return s;
}

bool has(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

TEST(SubmissionJsonTest, VelocitiesAreRotatedWithThePositionsIntoTheGlobalFrame) {
  // pred [2, 13]: sample, class, x, y, z, l, w, h, yaw, score, row, vx, vy.
  const at::Tensor pred = at::tensor({0., 1., 1., 2., 0.5, 4., 2., 1.5, 0., 0.5,  0., 3., -1.5,  //
                                      1., 0., 1., 2., 0.5, 4., 2., 1.5, 0., 0.75, 0., 3., -1.5},
                                     at::kDouble)
                              .reshape({2, 13});
  const std::string json = submission_json(pred, true, samples(), {"car", "truck"}, "{}");
  // Sample 0, the ego frame: as given.
  EXPECT_TRUE(has(json, "\"translation\": [1, 2, 0.5]")) << json;
  EXPECT_TRUE(has(json, "\"velocity\": [3, -1.5], \"detection_name\": \"truck\"")) << json;
  // Sample 1: positions (1, 2, 0.5) -> (98, 201, 1.5), velocities (3, -1.5) -> (1.5, 3).
  EXPECT_TRUE(has(json, "\"sample_token\": \"tok1\", \"translation\": [98, 201, 1.5]")) << json;
  EXPECT_TRUE(has(json, "\"velocity\": [1.5, 3], \"detection_name\": \"car\"")) << json;
  EXPECT_TRUE(has(json, "\"detection_score\": 0.75")) << json;
}

TEST(SubmissionJsonTest, AnUnknownGroundTruthVelocityIsWrittenNaN) {
  // gt [2, 11]: sample, class, x, y, z, l, w, h, yaw, vx, vy; the first unknown, in a posed sample.
  const at::Tensor gt = at::tensor({1., 0., 1., 2., 0.5, 4., 2., 1.5, 0., kNan, kNan,  //
                                    0., 0., 5., 5., 0.5, 4., 2., 1.5, 0., 0.25, 0.},
                                   at::kDouble)
                            .reshape({2, 11});
  const std::string json = submission_json(gt, false, samples(), {"car"}, "{}");
  EXPECT_TRUE(has(json, "\"velocity\": [NaN, NaN]")) << json;
  EXPECT_TRUE(has(json, "\"velocity\": [0.25, 0]")) << json;
  EXPECT_TRUE(has(json, "\"detection_score\": -1")) << json;
  EXPECT_FALSE(has(json, "nan")) << json;  // never C's spelling, which no JSON reader takes
}

TEST(SubmissionJsonTest, RowsWithoutVelocityColumnsSayZeroForPredictionsAndNaNForGroundTruth) {
  const at::Tensor pred =
      at::tensor({0., 0., 1., 2., 0.5, 4., 2., 1.5, 0., 0.5, 0.}, at::kDouble).reshape({1, 11});
  const at::Tensor gt =
      at::tensor({0., 0., 1., 2., 0.5, 4., 2., 1.5, 0.}, at::kDouble).reshape({1, 9});
  EXPECT_TRUE(has(submission_json(pred, true, samples(), {"car"}, "{}"), "\"velocity\": [0, 0]"));
  EXPECT_TRUE(
      has(submission_json(gt, false, samples(), {"car"}, "{}"), "\"velocity\": [NaN, NaN]"));
}

TEST(SubmissionJsonTest, ASceneIndexOutsideTheSplitIsRefused) {
  const at::Tensor pred =
      at::tensor({5., 0., 1., 2., 0.5, 4., 2., 1.5, 0., 0.5, 0., 0., 0.}, at::kDouble)
          .reshape({1, 13});
  EXPECT_THROW(submission_json(pred, true, samples(), {"car"}, "{}"), Error);
}

}  // namespace
}  // namespace parallax::launch
