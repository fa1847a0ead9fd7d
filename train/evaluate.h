// Evaluation on the validation split, distributed over the data-parallel group: each rank runs
// its disjoint share of the scenes, BEV IoU counts are summed and detections gathered across
// ranks, and every rank returns the same nuScenes-style metrics (docs/data.md):
//   val_loss, miou, iou_<bev class>, map, map_0.5m, map_1m, map_2m, map_4m, ap_<box class> (over
//   the thresholds), ap_2m_<box class>, ate, ase, aoe, ave, aae (true-positive errors at 2 m, means
//   over classes), ate_/ase_/aoe_/ave_<box class>, nds (the nuScenes detection score), nds_no_aae
//   (without the attribute term: data/detection_score.h).
// val_loss is the mean over the split's samples of each sample's own loss (the model's loss of a
// batch of that one sample), summed and counted in float64 across ranks: the same on any number of
// ranks and any batch size, up to the order of the float64 sum (and to any rounding the forward
// pass of a sample takes from its batch's shape: none on the CPU with one thread).
// Collective: every rank of `dp` must call it. The model is put in eval mode and back.
// Preemption (train/preemption.h): a rank that sees the signal stops before its next batch; the
// ranks learn it together in a collective after the loop and all throw train::PreemptedError.
// The split is `cfg.val_split`.
#pragma once

#include "comm/communicator.h"
#include "core/scene.h"
#include "data/data_config.h"
#include "models/model.h"
#include "optim/precision.h"

#include <map>
#include <string>
#include <vector>

namespace parallax::train {

// Every rank's detections and ground truth, gathered (identical on every rank), float64 (values
// of float32: they travel as float32), in the scenes' ego frame (data/detection_score.h):
//   pred [P, 13]: scene_index, class, x, y, z, l, w, h, yaw, score, row (within its scene), vx, vy;
//   gt   [G, 11]: scene_index, class, x, y, z, l, w, h, yaw, vx, vy (visible boxes of a class
//   only).
// Velocities in m/s: a prediction's from the postprocess output's `det_velocities` [B, K, 2], (0,
// 0) where the model has none; the ground truth's from the batch's `velocities` [B, max_boxes, 2],
// NaN where unknown or where the loader carries none.
struct EvalDetections {
  at::Tensor pred, gt;
};

// One batch's rows of EvalDetections, appended flat to `pred_rows` (13 per row) and `gt_rows` (11
// per row): from the postprocessed output `post` (det_boxes [B, K, 9], det_scores [B, K],
// det_velocities [B, K, 2] if present) and the batch (boxes [B, G, 9], scene_index [B], velocities
// [B, G, 2] if present). Predictions of a class outside [0, num_classes) and ground truth of such a
// class or with visibility 0 are left out. Throws Error naming the key when a velocity tensor's
// shape does not match its boxes'. (Exposed for tests.)
void append_eval_rows(const core::TensorDict& post, const core::TensorDict& batch,
                      int64_t num_classes, std::vector<double>& pred_rows,
                      std::vector<double>& gt_rows);

std::map<std::string, double> evaluate(models::Model& model, const data::DataConfig& cfg,
                                       const core::SceneSpec& scene, uint64_t seed,
                                       comm::Communicator& dp, const c10::Device& device,
                                       const optim::PrecisionPolicy& precision,
                                       EvalDetections* detections = nullptr);

}  // namespace parallax::train
