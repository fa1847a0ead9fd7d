#include "train/run_config.h"

namespace parallax::train {

RunConfig load_run_config(const std::string& file, const std::vector<std::string>& overrides) {
  return core::load_config<RunConfig>(file, overrides);
}

std::string resolved_yaml(RunConfig& cfg) { return core::emit_yaml(core::to_yaml(cfg)); }

}  // namespace parallax::train
