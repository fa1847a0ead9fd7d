// `parallax export --format safetensors` (launch/verb_export.cpp parses the command line).
#pragma once

#include "train/run_config.h"

#include <optional>
#include <string>

namespace parallax::launch {

// Writes the model tensors of `checkpoint` (default: <run>/checkpoints) to `out` (default:
// <run>/export/model.safetensors, or backbone.<convention>.safetensors) in `dtype` (fp32 | bf16):
// every tensor with Parallax's names, or with `convention` (timm | torchvision) the backbone's
// with that library's names (checkpoint/pretrained.h to_convention). A NaN/inf tensor refuses the
// export unless `force`. Throws UsageError / ConfigError / CheckpointError / IoError.
int export_safetensors(const std::string& run, const std::string& checkpoint,
                       const std::string& out, const std::string& dtype,
                       const std::string& convention, bool force,
                       const std::optional<train::RunConfig>& cfg);

}  // namespace parallax::launch
