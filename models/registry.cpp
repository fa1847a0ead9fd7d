#include "core/error.h"
#include "models/mlp.h"
#include "models/model.h"

namespace parallax::models {

int64_t Model::parameter_count() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

std::shared_ptr<Model> build_model(const ModelConfig& cfg, const core::SceneSpec& /*scene*/) {
  if (cfg.name == "mlp") {
    if (cfg.size == "tiny") return std::make_shared<MlpModel>(32, 64, 8, 2);
    if (cfg.size == "small") return std::make_shared<MlpModel>(256, 1024, 64, 4);
    throw_error<ConfigError>("key 'model.size': model 'mlp' has sizes tiny|small, got '{}'", cfg.size);
  }
  throw_error<ConfigError>("key 'model.name': model '{}' (size '{}') is not built yet in this version",
                           cfg.name, cfg.size);
}

}  // namespace parallax::models
