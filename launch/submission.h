// The nuScenes detection submission JSON that `parallax eval --dump-predictions` writes (the
// detections, and the ground truth in the same format): docs/data.md, "`parallax eval` and
// nuScenes-format predictions".
#pragma once

#include "data/shard.h"

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace parallax::launch {

// `rows` (train::EvalDetections: pred [P, 13] when `predictions`, else gt [G, 11]; the older
// 11- and 9-column layouts without velocity too) as the submission JSON: every scene of the
// split is a sample (token = its sample token, or its scene index), listed even without boxes.
// Boxes and velocities are in the scene's ego frame, or in the source's global frame where the
// scene holds its ego pose (a converted nuScenes dataset: what the devkit's ground truth is in;
// velocities are rotated, as the devkit's are differences of global positions). An unknown
// velocity is written `NaN` (submission.cpp says why). Ground truth carries detection_score -1,
// as the devkit's ground-truth boxes do. `meta` is the "meta" object's JSON text. Throws Error
// for a row whose scene index is outside `samples`.
std::string submission_json(const at::Tensor& rows, bool predictions,
                            const std::vector<data::SampleMeta>& samples,
                            const std::vector<std::string>& classes, const std::string& meta);

}  // namespace parallax::launch
