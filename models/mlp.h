// `mlp`: a small regression model, the stand-in the trainer and the parallel engines are tested
// with where a perception model would make the test slow. Input "x" [B, in], target "y" [B, out];
// loss is mean squared error.
#pragma once

#include "models/model.h"

#include <torch/nn/modules/container/sequential.h>

namespace parallax::models {

class MlpModel : public Model {
 public:
  MlpModel(int64_t in_features, int64_t hidden, int64_t out_features, int64_t depth);

  core::TensorDict forward(const core::TensorDict& batch) override;
  // The chain (models/model.h): begin {x}; one unit per Linear (with its GELU) -> {y_hat}.
  int chain_length() const override { return static_cast<int>(depth_) + 1; }
  std::vector<at::Tensor> chain_begin(const core::TensorDict& batch) override;
  std::vector<at::Tensor> chain_unit(int unit, const core::TensorDict& batch,
                                     const std::vector<at::Tensor>& in) override;
  core::TensorDict chain_end(const core::TensorDict& batch,
                             const std::vector<at::Tensor>& out) override;
  LossOutput loss(const core::TensorDict& batch, const core::TensorDict& pred) override;
  double forward_flops_per_sample() const override;
  int64_t batch_size(const core::TensorDict& batch) const override;
  core::TensorDict example_batch(int64_t n) const override;
  std::vector<ModuleCost> cost_breakdown() const override;
  // One unit per linear layer with the GELU after it: "net.0", "net.2", ..., "net.<2 depth>".
  std::vector<Unit> units() const override;
  std::vector<UnitActivation> unit_activations(
      const ActivationQuery& q) const override;  // models/activations.cpp
  // Input "x" float32 [B, in], output "y_hat" float32 [B, out].
  // Input "x", output "y_hat"; a unit per Linear (with its GELU) (models/onnx/mlp_onnx.cpp).
  OnnxFlow emit_onnx_inputs(onnx::Emitter& e) override;
  std::vector<onnx::Value> emit_onnx_unit(onnx::Emitter& e, int unit,
                                          const OnnxFlow& flow) override;
  void emit_onnx_outputs(onnx::Emitter& e, const OnnxFlow& flow) override;

 private:
  int64_t in_, hidden_, out_, depth_;
  torch::nn::Sequential net_{nullptr};
  at::Tensor teacher_;  // fixed random map that defines the regression target
};

}  // namespace parallax::models
