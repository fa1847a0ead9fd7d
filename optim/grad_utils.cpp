#include "optim/grad_utils.h"

#include "core/error.h"
#include "core/log.h"

#include <ATen/ATen.h>

#include <cmath>

namespace parallax::optim {

using parallel::comm::Communicator;
using parallel::comm::ReduceOp;

at::Tensor clip_grad_norm(const std::vector<at::Tensor>& grads, double max_norm,
                          const std::vector<Communicator*>& shard_groups) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> defined;
  for (const auto& g : grads) {
    if (g.defined() && g.numel() > 0) defined.push_back(g);
  }
  at::Tensor sq;
  if (defined.empty()) {
    sq = at::zeros({}, at::kFloat);
  } else {
    // Per-tensor norms in fp32 (the fused foreach kernel), then the sum of their squares.
    const auto norms = at::_foreach_norm(defined, 2, at::kFloat);
    sq = at::stack(norms).pow(2).sum();
  }
  for (Communicator* c : shard_groups) {
    if (!c || c->size() == 1) continue;
    if (sq.device().type() != c->device_type()) {
      at::Tensor tmp = sq.to(c->device_type() == c10::DeviceType::CPU ? at::Device(at::kCPU) : sq.device());
      c->all_reduce(tmp, ReduceOp::kSum);
      sq = tmp.to(sq.device());
    } else {
      c->all_reduce(sq, ReduceOp::kSum);
    }
  }
  at::Tensor norm = sq.sqrt();
  if (max_norm > 0 && !defined.empty()) {
    // coef = min(1, max_norm / (norm + eps)); a non-finite norm gives coef 1 (grads untouched) so
    // the loss scaler or the NaN check, not the clipper, decides what happens.
    at::Tensor coef = (max_norm / (norm + 1e-6)).clamp_max(1.0);
    coef = at::where(at::isfinite(coef), coef, at::ones_like(coef));
    at::_foreach_mul_(defined, coef);
  }
  return norm;
}

LossScaler::LossScaler(bool enabled, double init_scale, int64_t growth_interval, double min_scale)
    : enabled_(enabled), scale_(enabled ? init_scale : 1.0), growth_interval_(growth_interval),
      min_scale_(min_scale) {}

at::Tensor LossScaler::scale_loss(const at::Tensor& loss) const { return enabled_ ? loss * scale_ : loss; }

bool LossScaler::unscale_and_check(const std::vector<at::Tensor>& grads,
                                   const std::vector<Communicator*>& shard_groups) {
  if (!enabled_) return false;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> defined;
  for (const auto& g : grads) {
    if (g.defined() && g.numel() > 0) defined.push_back(g);
  }
  const at::Device dev = defined.empty() ? at::Device(at::kCPU) : defined.front().device();
  at::Tensor found = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(dev));
  const at::Tensor inv = at::full({1}, 1.0 / scale_, at::TensorOptions().dtype(at::kFloat).device(dev));
  // The kernel needs one device and dtype per call: group the grads by dtype.
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (auto& g : defined) by_dtype[g.scalar_type()].push_back(g);
  for (auto& [dt, list] : by_dtype) at::_amp_foreach_non_finite_check_and_unscale_(list, found, inv);
  for (Communicator* c : shard_groups) {
    if (!c || c->size() == 1) continue;
    at::Tensor tmp = found.device().type() == c->device_type() ? found : found.cpu();
    c->all_reduce(tmp, ReduceOp::kMax);
    found = tmp.to(dev);
  }
  return found.item<float>() > 0;
}

void LossScaler::update(bool found_inf) {
  if (!enabled_) return;
  if (found_inf) {
    ++skipped_;
    clean_ = 0;
    const double next = scale_ * 0.5;
    if (next < min_scale_) {
      throw_error<NumericsError>(
          "fp16 loss scale collapsed: overflow at scale {} and halving would go below the floor {} "
          "({} steps skipped so far); the model diverged: lower optim.lr, use precision.mode=bf16, "
          "or lower precision.loss_scale_min",
          scale_, min_scale_, skipped_);
    }
    core::log::warn("fp16: inf/NaN gradients, step skipped; loss scale {} -> {}", scale_, next);
    scale_ = next;
    return;
  }
  if (++clean_ >= growth_interval_) {
    scale_ *= 2.0;
    clean_ = 0;
  }
}

void LossScaler::load(double scale, int64_t clean_steps, int64_t skipped_steps) {
  scale_ = scale;
  clean_ = clean_steps;
  skipped_ = skipped_steps;
}

}  // namespace parallax::optim
