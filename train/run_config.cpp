#include "train/run_config.h"

#include "data/loader.h"
#include "data/schema.h"
#include "models/perception_model.h"

namespace parallax::train {

RunConfig load_run_config(const std::string& file, const std::vector<std::string>& overrides) {
  return core::load_config<RunConfig>(file, overrides);
}

std::string resolved_yaml(RunConfig& cfg) {
  return core::emit_yaml(core::to_yaml(cfg));
}

bool uses_synthetic_data(const RunConfig& cfg) {
  return cfg.data.synthetic || cfg.train.benchmark || cfg.model.name != "bev";
}

core::SceneSpec run_scene(const RunConfig& cfg) {
  if (!uses_synthetic_data(cfg))
    return data::loader_scene_spec(data::read_dataset_info(cfg.data.path), cfg.data);
  if (cfg.model.name == "bev") return models::benchmark_scene(cfg.model.size);
  return {};
}

}  // namespace parallax::train
