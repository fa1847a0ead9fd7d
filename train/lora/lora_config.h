// The `lora` config section (docs/configs.md, docs/trainers.md "LoRA"): the adapters' rank, scale,
// dropout and targets. Apart from the trainer (lora.h) so that the run config
// (train/run_config.h) and every config reader see the section without compiling the trainer.
#pragma once

#include "core/config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace parallax::train {

struct LoraConfig {
  int64_t rank = 0;  // 0: off
  double alpha = 16;
  double dropout = 0;
  std::vector<std::string> targets = {"*.qkv", "*.proj", "*.fc1", "*.fc2"};
  std::vector<std::string> trainable;  // parameter-name globs trained beside the adapters
  std::string base;                    // base weights; "" -> train.load_from

  template <class V>
  void visit(V& v) {
    v("rank", rank, "LoRA rank r of the adapters (0: no LoRA)", core::Check::at_least(0));
    v("alpha", alpha, "LoRA scale numerator: the adapter's output is multiplied by alpha / rank",
      core::Check::positive());
    v("dropout", dropout, "dropout on the adapters' input (training only)",
      core::Check::between(0, 0.99));
    v("targets", targets,
      "module-path globs of the linear layers that get adapters (e.g. '*.attn.qkv', "
      "'*.mlp.fc1'); each must match at least one");
    v("trainable", trainable,
      "parameter-name globs trained in full beside the adapters (e.g. 'heads.*'); saved in the "
      "adapter checkpoints");
    v("base", base,
      "the base model: a checkpoint, run directory or weights.h5 ('' uses train.load_from)");
  }
};

}  // namespace parallax::train
