// A named collection of tensors: how batches, predictions and loss terms travel between the data
// loader, the models and the trainer without those layers knowing each other's types.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>

namespace parallax::core {

using TensorDict = std::map<std::string, at::Tensor>;

// Moves every tensor to `device` (non_blocking when the source is pinned).
inline TensorDict to_device(const TensorDict& d, const c10::Device& device,
                            bool non_blocking = true) {
  TensorDict out;
  for (const auto& [k, v] : d) out.emplace(k, v.defined() ? v.to(device, non_blocking) : v);
  return out;
}

}  // namespace parallax::core
