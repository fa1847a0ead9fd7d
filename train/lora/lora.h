// LoRA fine-tuning (`lora` config section, docs/trainers.md): low-rank adapters on the linear
// layers that `lora.targets` names, the rest of the model frozen, adapter-only checkpoints tied to
// their base by a fingerprint, and merged exports. Built on the Trainer's extension points
// (train/trainer.h): a model transform, a filter on the checkpointed model tensors, and extra
// checkpoint entries.
//
// A run: the model is built, the base weights (`lora.base`, else `train.load_from`, which the
// trainer loads; one is required) are loaded, their fingerprint taken, adapters added to every
// DenseLinear whose module path matches a glob of `lora.targets` (models/layers.h: y += alpha / r *
// dropout(x) A^T B^T, B = 0 at the start), and every parameter frozen but the adapters and those
// matching `lora.trainable`. Frozen base weights get no gradient, no optimizer state and no
// gradient bucket; under ZeRO-3 they are sharded like the rest. Checkpoints hold only the trainable
// tensors (and the base's fingerprint and path); a resume loads the base again, then the adapters,
// and refuses a base whose fingerprint differs. `parallax export` merges the adapters into the base
// (W += alpha / r * B A) for weights.h5 and ONNX (merged_model()).
#pragma once

#include "checkpoint/reader.h"
#include "core/scene.h"
#include "models/model.h"
#include "train/lora/lora_config.h"

#include <memory>
#include <string>
#include <vector>

namespace parallax::train {

struct RunConfig;
struct TrainerHooks;
class Extension;

namespace lora {

// True for an adapter parameter's name ("<module path>.lora_a" / ".lora_b").
bool is_adapter(const std::string& name);

// crc32 over the names, shapes, dtypes and bytes of every parameter and buffer of `m` (CPU copies,
// tensor by tensor), as 8 hex digits: what ties an adapter to its base. `value(name, tensor)`, when
// given, supplies each tensor's values (a model built without storage: its recipes, one at a time).
std::string fingerprint(
    const torch::nn::Module& m,
    const std::function<at::Tensor(const std::string& name, const at::Tensor& t)>& value = {});

struct Applied {
  int64_t layers = 0;          // linear layers with an adapter
  int64_t adapter_params = 0;  // elements of lora_a and lora_b
  int64_t trainable = 0;       // adapters plus `trainable` matches
  int64_t total = 0;           // every parameter
};
// Adds the adapters and freezes the rest. ConfigError naming the key when a target glob matches no
// linear layer (listing some that exist), or matches a module that is not a DenseLinear, or a
// `trainable` glob matches no parameter.
Applied apply(models::Model& model, const LoraConfig& cfg);

// The base path of a run (lora.base, else train.load_from); ConfigError when neither is set.
std::string base_path(const RunConfig& cfg);

// The Trainer's hooks for a LoRA run of `cfg` (cfg.lora.rank > 0). The hooks keep a pointer to
// `cfg`, which must outlive the Trainer.
TrainerHooks hooks(const RunConfig& cfg);
// The `lora` section of `cfg` (train/config_sections.h).
const LoraConfig& config(const RunConfig& cfg);
LoraConfig& config(RunConfig& cfg);
// LoRA as a trainer extension (train/extension.h; registered in train/extensions.cpp).
const Extension& extension();

// For export: the run's model with the base loaded, the adapters of `reader` (a checkpoint of the
// run) loaded after checking the base's fingerprint, and every adapter merged into its weight, so
// the model has no adapter parameters left. CheckpointError for a base that does not match.
std::shared_ptr<models::Model> merged_model(const RunConfig& cfg, const core::SceneSpec& scene,
                                            checkpoint::CheckpointReader& reader);

}  // namespace lora
}  // namespace parallax::train
