#include "optim/grad_utils.h"

#include "core/error.h"
#include "core/log.h"

#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <string>

namespace parallax::optim {

using comm::Communicator;
using comm::ReduceOp;

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
      at::Tensor tmp =
          sq.to(c->device_type() == c10::DeviceType::CPU ? at::Device(at::kCPU) : sq.device());
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

namespace {

// A group's communicators as a rank-independent key (pointers differ between processes).
std::string groups_key(const std::vector<Communicator*>& comms) {
  std::string key;
  for (const Communicator* c : comms) {
    if (!c || c->size() == 1) continue;
    key += c->name();
    key += '|';
  }
  return key;
}

std::vector<Communicator*> active(const std::vector<Communicator*>& comms) {
  std::vector<Communicator*> out;
  for (Communicator* c : comms)
    if (c && c->size() > 1) out.push_back(c);
  return out;
}

}  // namespace

at::Tensor clip_grad_norm(const std::vector<GradGroup>& groups, double max_norm) {
  at::NoGradGuard no_grad;
  // Sum of squares per distinct set of shard communicators, each all-reduced once over that set.
  std::map<std::string, std::pair<std::vector<Communicator*>, std::vector<at::Tensor>>> by_key;
  std::vector<at::Tensor> all;
  for (const auto& g : groups) {
    auto& slot = by_key[groups_key(g.sharded_over)];
    slot.first = active(g.sharded_over);
    for (const auto& t : g.grads) {
      if (t.defined() && t.numel() > 0) {
        slot.second.push_back(t);
        all.push_back(t);
      }
    }
  }
  at::Tensor total;
  for (auto& [key, entry] : by_key) {  // sorted by key: the same order on every rank
    at::Tensor norm = clip_grad_norm(entry.second, 0.0, entry.first);
    at::Tensor sq = norm.pow(2);
    if (total.defined() && total.device() != sq.device()) sq = sq.to(total.device());
    total = total.defined() ? total + sq : sq;
  }
  if (!total.defined()) total = at::zeros({}, at::kFloat);
  at::Tensor norm = total.sqrt();
  if (max_norm > 0 && !all.empty()) {
    at::Tensor coef = (max_norm / (norm + 1e-6)).clamp_max(1.0);
    coef = at::where(at::isfinite(coef), coef, at::ones_like(coef));
    std::map<std::string, std::vector<at::Tensor>> by_device;  // one foreach call per device
    for (auto& t : all) by_device[t.device().str()].push_back(t);
    for (auto& [dev, list] : by_device) {
      const at::Device d = list.front().device();
      at::_foreach_mul_(list, coef.device() == d ? coef : coef.to(d));
    }
  }
  return norm;
}

LossScaler::LossScaler(bool enabled, double init_scale, int64_t growth_interval, double min_scale)
    : enabled_(enabled),
      scale_(enabled ? init_scale : 1.0),
      growth_interval_(growth_interval),
      min_scale_(min_scale) {}

at::Tensor LossScaler::scale_loss(const at::Tensor& loss) const {
  return enabled_ ? loss * scale_ : loss;
}

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
  const at::Tensor inv =
      at::full({1}, 1.0 / scale_, at::TensorOptions().dtype(at::kFloat).device(dev));
  // The kernel needs one device and dtype per call: group the grads by dtype.
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (auto& g : defined) by_dtype[g.scalar_type()].push_back(g);
  for (auto& [dt, list] : by_dtype)
    at::_amp_foreach_non_finite_check_and_unscale_(list, found, inv);
  for (Communicator* c : shard_groups) {
    if (!c || c->size() == 1) continue;
    at::Tensor tmp = found.device().type() == c->device_type() ? found : found.cpu();
    c->all_reduce(tmp, ReduceOp::kMax);
    found = tmp.to(dev);
  }
  return found.item<float>() > 0;
}

bool LossScaler::unscale_and_check(const std::vector<GradGroup>& groups) {
  if (!enabled_) return false;
  std::vector<at::Tensor> grads;
  std::map<std::string, Communicator*> comms;  // every shard communicator once, in name order
  for (const auto& g : groups) {
    grads.insert(grads.end(), g.grads.begin(), g.grads.end());
    for (Communicator* c : active(g.sharded_over)) comms.emplace(c->name(), c);
  }
  std::vector<Communicator*> list;
  for (auto& [name, c] : comms) list.push_back(c);
  return unscale_and_check(grads, list);
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
