// Helpers the model-parallel tests share (tests/parallel/tensor_parallel_test.cpp,
// pipeline_test.cpp): optimizer groups over a module, plain SGD with momentum, the tiny models
// they split, and a rank's slice of a tensor-parallel parameter. Header-only.
#pragma once

#include "models/model_config.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "parallel/engine.h"
#include "parallel/tensor/tensor_parallel.h"

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>
#include <vector>

namespace parallax::testing {

inline std::vector<optim::ParamGroup> groups_of(torch::nn::Module& m) {
  optim::NamedParams named;
  for (const auto& it : m.named_parameters()) named.emplace_back(it.key(), it.value());
  return optim::make_param_groups(named, 0.0);
}

// SGD, momentum 0.9, no Nesterov.
inline parallel::OptimizerFactory sgd() {
  return [](std::vector<optim::ParamGroup> g) {
    return std::make_unique<optim::Sgd>(std::move(g), 0.9, false, true);
  };
}

inline models::ModelConfig vit_cls_config() {
  models::ModelConfig cfg;
  cfg.name = "vit_cls";
  cfg.size = "tiny";
  cfg.num_classes = 8;
  return cfg;
}

inline models::ModelConfig bev_vit_config() {
  models::ModelConfig cfg;
  cfg.name = "bev";
  cfg.size = "tiny";
  cfg.backbone = "vit";
  return cfg;
}

// This rank's part of the whole single-process tensor `full`, as `layout` splits it (local shape
// `local`): the boxes of split_boxes, taken out of `full` and stacked along the split dimension.
inline at::Tensor local_part(const at::Tensor& full, const parallel::tensor::ParamLayout& layout,
                             const at::Tensor& local) {
  std::vector<at::Tensor> parts;
  for (const auto& box : parallel::tensor::split_boxes(local, layout)) {
    at::Tensor p = full;
    for (int64_t d = 0; d < box.local.dim(); ++d)
      p = p.narrow(d, box.offsets[static_cast<std::size_t>(d)], box.local.size(d));
    parts.push_back(p);
  }
  return at::cat(parts, layout.dim);
}

}  // namespace parallax::testing
