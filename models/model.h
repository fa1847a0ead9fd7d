// The interface every model of the zoo implements, and the registry that builds them by name.
//
// A model maps a batch (named tensors from the data layer) to predictions and computes its own
// loss terms, so the trainer stays model-agnostic. Models never call collectives themselves;
// tensor-parallel layers borrowed from parallel/tensor do.
#pragma once

#include "core/scene.h"
#include "core/tensor_dict.h"
#include "models/model_config.h"

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

namespace parallax::models {

struct LossOutput {
  at::Tensor total;              // scalar, what backward() runs on
  core::TensorDict terms;        // each named term (detached or not), for metrics
};

class Model : public torch::nn::Module {
 public:
  // Predictions for a batch (keys are model-specific, e.g. "bev_logits", "heatmap").
  virtual core::TensorDict forward(const core::TensorDict& batch) = 0;
  // Loss terms and their weighted total for `batch` given `pred` from forward().
  virtual LossOutput loss(const core::TensorDict& batch, const core::TensorDict& pred) = 0;
  // Forward FLOPs for one sample (multiply-add = 2 FLOPs); used for MFU (training ~ 3x forward).
  virtual double forward_flops_per_sample() const = 0;
  // Blocks that activation checkpointing may wrap (transformer blocks); empty if none.
  virtual std::vector<std::shared_ptr<torch::nn::Module>> checkpointable_blocks() { return {}; }
  // Decoded outputs for evaluation and export (e.g. "bev_labels" [B, X, Y] int64, "det_boxes"
  // [B, K, 9] and "det_scores" [B, K]); the default returns `pred` unchanged.
  virtual core::TensorDict postprocess(const core::TensorDict& pred) { return pred; }
  // Samples in a batch (the leading dimension of the model's main input).
  virtual int64_t batch_size(const core::TensorDict& batch) const = 0;
  // A random batch of `n` samples with the shapes and dtypes the model expects (benchmark mode
  // and tests), drawn from the default CPU generator.
  virtual core::TensorDict example_batch(int64_t n) const = 0;

  int64_t parameter_count() const;
};

// Builds a model of the zoo by `cfg.name` and `cfg.size` for data described by `scene`; throws
// ConfigError for unknown names or sizes, or a scene the model cannot take.
std::shared_ptr<Model> build_model(const ModelConfig& cfg, const core::SceneSpec& scene);

}  // namespace parallax::models
