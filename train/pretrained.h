// How train.load_from's weights (and lora.base's, the distillation teacher's) go into a model:
// WeightsOptions (checkpoint/weights.h) from model.pretrained and train.strict_load and the model's
// backbone (checkpoint/pretrained.h does the mapping).
#pragma once

#include "checkpoint/weights.h"
#include "models/model.h"
#include "train/run_config.h"

#include <string>

namespace parallax::train {

// Options for loading `path` into `model` under `cfg`: a foreign file (safetensors, torch.save)
// maps through model.pretrained (strict: model.pretrained.strict); a Parallax checkpoint or
// weights.h5 follows train.strict_load. model.pretrained.target=backbone limits the load to the
// model's backbone (ConfigError naming the key for a model without one). Throws ConfigError.
checkpoint::WeightsOptions pretrained_load_options(const RunConfig& cfg, const models::Model& model,
                                                   const std::string& path);

}  // namespace parallax::train
