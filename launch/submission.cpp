#include "launch/submission.h"

#include "core/error.h"
#include "core/strings.h"
#include "data/detection_score.h"
#include "data/geometry.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <array>
#include <cmath>

namespace parallax::launch {
namespace {

// A velocity component for the submission JSON. JSON has no NaN, but the devkit reads every
// submission with Python's json.load, which takes the token `NaN` (and json.dump writes it) as
// numpy's nan: its velocity_l2 then gives NaN, which its running mean skips, exactly as for a
// ground truth without velocity. `null` would load as None and fail there. So an unknown
// ground-truth velocity is written `NaN` (docs/data.md); predictions' velocities are finite.
std::string json_velocity(double v) {
  return std::isnan(v) ? "NaN" : fmt::format("{}", v);
}

}  // namespace

std::string submission_json(const at::Tensor& rows, bool predictions,
                            const std::vector<data::SampleMeta>& samples,
                            const std::vector<std::string>& classes, const std::string& meta) {
  const auto scenes = static_cast<int64_t>(samples.size());
  std::vector<std::string> tokens;
  for (size_t i = 0; i < samples.size(); ++i)
    tokens.push_back(samples[i].token.empty() ? std::to_string(i) : samples[i].token);
  const at::Tensor r = rows.to(at::kDouble).contiguous();
  const int64_t cols = r.size(1);
  // The velocity columns of the two layouts (train/evaluate.h); none in an older layout.
  const int64_t vcol = predictions ? data::kTpPredColumns - 2 : data::kTpGtColumns - 2;
  const bool has_velocity = cols >= vcol + 2;
  const double* p = r.data_ptr<double>();
  std::vector<std::vector<std::string>> by_sample(static_cast<size_t>(scenes));
  for (int64_t i = 0; i < r.size(0); ++i) {
    const double* q = p + i * cols;
    const int64_t sample = std::lround(q[0]);
    PARALLAX_CHECK(sample >= 0 && sample < scenes, Error,
                   "eval: scene index {} outside the split's {} scenes", sample, scenes);
    const double yaw = q[8];
    double x = q[2], y = q[3], z = q[4];
    // Without velocity columns: a prediction says (0, 0), the ground truth is unknown.
    double vx = has_velocity ? q[vcol] : predictions ? 0.0 : NAN;
    double vy = has_velocity ? q[vcol + 1] : predictions ? 0.0 : NAN;
    std::array<double, 4> rot = {std::cos(yaw / 2), 0.0, 0.0, std::sin(yaw / 2)};
    const at::Tensor& pose = samples[static_cast<size_t>(sample)].ego_to_global;
    if (pose.defined()) {
      const double* T = pose.data_ptr<double>();
      namespace geom = data::geom;
      geom::Mat3 R;
      for (int a = 0; a < 3; ++a) {
        for (int b = 0; b < 3; ++b) R.m[a][b] = T[a * 4 + b];
      }
      const geom::Vec3 g = R * geom::Vec3{x, y, z} + geom::Vec3{T[3], T[7], T[11]};
      x = g.x, y = g.y, z = g.z;
      rot = geom::quaternion_wxyz(R * geom::Mat3::rot_z(yaw));
      // A ground velocity (vx, vy, 0) rotated; NaN stays NaN.
      const geom::Vec3 v = R * geom::Vec3{vx, vy, 0.0};
      vx = v.x, vy = v.y;
    }
    by_sample[static_cast<size_t>(sample)].push_back(fmt::format(
        "{{\"sample_token\": \"{}\", \"translation\": [{}, {}, {}], \"size\": [{}, {}, {}], "
        "\"rotation\": [{}, {}, {}, {}], \"velocity\": [{}, {}], \"detection_name\": {}, "
        "\"detection_score\": {}, \"attribute_name\": \"\"}}",
        tokens[static_cast<size_t>(sample)], x, y, z, q[6], q[5], q[7], rot[0], rot[1], rot[2],
        rot[3], json_velocity(vx), json_velocity(vy),
        core::json_quote(classes.at(static_cast<size_t>(std::lround(q[1])))),
        predictions ? q[9] : -1.0));
  }
  std::string out = fmt::format("{{\"meta\": {},\n\"results\": {{", meta);
  for (int64_t s = 0; s < scenes; ++s) {
    out += fmt::format("{}\n\"{}\": [{}]", s ? "," : "", tokens[static_cast<size_t>(s)],
                       core::join(by_sample[static_cast<size_t>(s)], ",\n  "));
  }
  return out + "}}\n";
}

}  // namespace parallax::launch
