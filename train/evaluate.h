// Evaluation on the validation split, distributed over the data-parallel group: each rank runs
// its disjoint share of the scenes, BEV IoU counts are summed and detections gathered across
// ranks, and every rank returns the same nuScenes-style metrics (docs/data.md):
//   val_loss, miou, iou_<bev class>, map, map_0.5m, map_1m, map_2m, map_4m, ap_2m_<box class>.
// Collective: every rank of `dp` must call it. The model is put in eval mode and back.
#pragma once

#include "core/scene.h"
#include "data/data_config.h"
#include "models/model.h"
#include "optim/precision.h"
#include "parallel/comm/communicator.h"

#include <map>
#include <string>

namespace parallax::train {

std::map<std::string, double> evaluate(models::Model& model, const data::DataConfig& cfg, const core::SceneSpec& scene,
                                       uint64_t seed, parallel::comm::Communicator& dp, const c10::Device& device,
                                       const optim::PrecisionPolicy& precision);

}  // namespace parallax::train
