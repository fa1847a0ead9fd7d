#include "train/run_config.h"

#include "core/error.h"
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

void check_frames(const RunConfig& cfg) {
  // The loader's frames feed the temporal model's: one number for both (synthetic batches come
  // with the model's frames, so data.frames may stay 1 there).
  const int model_frames = cfg.model.name == "bev" ? cfg.model.temporal.frames : 1;
  if (cfg.data.frames != model_frames && (cfg.data.frames != 1 || !uses_synthetic_data(cfg))) {
    throw_error<ConfigError>(
        "keys 'data.frames' ({}) and 'model.temporal.frames' ({}) differ: a temporal model sees "
        "as many keyframes as the loader gives; set both to the same number",
        cfg.data.frames, model_frames);
  }
}

core::SceneSpec run_scene(const RunConfig& cfg) {
  check_frames(cfg);
  if (!uses_synthetic_data(cfg))
    return data::loader_scene_spec(data::read_dataset_info(cfg.data.path), cfg.data);
  if (cfg.model.name == "bev") return models::benchmark_scene(cfg.model.size);
  return {};
}

}  // namespace parallax::train
