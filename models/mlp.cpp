#include "models/mlp.h"

#include "core/error.h"
#include "units/param_init.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

namespace parallax::models {

MlpModel::MlpModel(int64_t in_features, int64_t hidden, int64_t out_features, int64_t depth)
    : in_(in_features), hidden_(hidden), out_(out_features), depth_(depth) {
  net_ = register_module("net", torch::nn::Sequential());
  int64_t width = in_;
  for (int64_t i = 0; i < depth_; ++i) {
    net_->push_back(units::layer<torch::nn::Linear>(torch::nn::LinearOptions(width, hidden_)));
    net_->push_back(torch::nn::GELU());
    width = hidden_;
  }
  net_->push_back(units::layer<torch::nn::Linear>(torch::nn::LinearOptions(width, out_)));
  // The target function is part of the model definition (a buffer), so every rank agrees on it.
  const int64_t in = in_, out = out_;
  teacher_ = register_buffer("teacher", units::init_tensor({in_, out_}, [in, out]() {
                               return at::randn({in, out}) / std::sqrt(static_cast<double>(in));
                             }));
}

core::TensorDict MlpModel::forward(const core::TensorDict& batch) {
  return forward_chain(batch);
}

std::vector<at::Tensor> MlpModel::chain_begin(const core::TensorDict& batch) {
  return {batch.at("x")};
}

// net_ is [Linear, GELU] x depth, Linear: unit k runs modules 2k and 2k + 1 (see units()).
std::vector<at::Tensor> MlpModel::chain_unit(int unit, const core::TensorDict&,
                                             const std::vector<at::Tensor>& in) {
  PARALLAX_CHECK(unit >= 0 && unit <= depth_, Error, "mlp: no unit {} (it has {})", unit,
                 depth_ + 1);
  const auto modules = net_->begin();
  const int64_t n = static_cast<int64_t>(net_->size());
  const int64_t i = 2 * static_cast<int64_t>(unit);
  at::Tensor y = modules[i].forward(in.at(0));
  return {i + 1 < n ? modules[i + 1].forward(y) : y};
}

core::TensorDict MlpModel::chain_end(const core::TensorDict&, const std::vector<at::Tensor>& out) {
  return {{"y_hat", out.at(0)}};
}

std::vector<Unit> MlpModel::units() const {
  std::vector<UnitPaths> specs;
  for (int64_t i = 0; i <= depth_; ++i) {
    const std::string path = "net." + std::to_string(2 * i);
    specs.push_back({path, {path}});
  }
  return resolve_units(*this, specs);
}

LossOutput MlpModel::loss(const core::TensorDict& batch, const core::TensorDict& pred) {
  const at::Tensor x = batch.at("x");
  const at::Tensor target =
      batch.count("y") ? batch.at("y") : at::tanh(x.matmul(teacher_.to(x.dtype())));
  at::Tensor mse = (pred.at("y_hat").to(at::kFloat) - target.to(at::kFloat)).pow(2).mean();
  return {mse, {{"mse", mse.detach()}}};
}

double MlpModel::forward_flops_per_sample() const {
  double f = 0;
  int64_t width = in_;
  for (int64_t i = 0; i < depth_; ++i) {
    f += 2.0 * width * hidden_;
    width = hidden_;
  }
  return f + 2.0 * width * out_;
}

std::vector<ModuleCost> MlpModel::cost_breakdown() const {
  return {{"mlp", parameter_count(), forward_flops_per_sample()}};
}

int64_t MlpModel::batch_size(const core::TensorDict& batch) const {
  return batch.at("x").size(0);
}

core::TensorDict MlpModel::example_batch(int64_t n) const {
  at::Tensor x = at::randn({n, in_});
  // On the CPU like the rest of the batch, wherever the model (and so its buffer) lives.
  return {{"x", x}, {"y", at::tanh(x.matmul(teacher_.to(at::kCPU)))}};
}

}  // namespace parallax::models
