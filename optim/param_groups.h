// Parameter groups: which parameters get weight decay. Follows the convention of timm, Megatron
// and nanoGPT: biases, normalisation weights and every other 1-D parameter, plus embeddings named
// in `no_decay_names` (position embeddings, class tokens), get no weight decay. Frozen
// parameters (requires_grad false, e.g. a LoRA base) are left out.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace parallax::optim {

struct ParamGroup {
  std::string name;                // "decay" | "no_decay" (or a caller's label)
  std::vector<std::string> names;  // module paths, parallel to `params`
  std::vector<at::Tensor> params;
  double weight_decay = 0;
};

using NamedParams = std::vector<std::pair<std::string, at::Tensor>>;

// Substrings of parameter names that never decay, besides 1-D tensors.
const std::vector<std::string>& default_no_decay_names();

// Two groups ("decay", "no_decay"), empty ones dropped; order of parameters preserved.
std::vector<ParamGroup> make_param_groups(
    const NamedParams& params, double weight_decay,
    const std::vector<std::string>& no_decay_names = default_no_decay_names());

}  // namespace parallax::optim
