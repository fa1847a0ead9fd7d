#include "optim/optimizer.h"

#include "core/error.h"

#include <ATen/ATen.h>

#include <cmath>

namespace parallax::optim {

Optimizer::Optimizer(std::vector<ParamGroup> groups) : groups_(std::move(groups)) {
  slots_.resize(groups_.size());
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const auto& grp = groups_[g];
    for (std::size_t i = 0; i < grp.params.size(); ++i) {
      Slot s;
      s.param = grp.params[i];
      s.name = i < grp.names.size() ? grp.names[i] : fmt::format("{}.{}", grp.name, i);
      s.weight_decay = grp.weight_decay;
      // Low-precision storage gets an fp32 master copy so small updates are not rounded away.
      s.master = s.param.scalar_type() == at::kFloat || s.param.scalar_type() == at::kDouble
                     ? s.param
                     : s.param.detach().to(at::kFloat).clone();
      slots_[g].push_back(std::move(s));
    }
  }
}

void Optimizer::step(double lr) {
  at::NoGradGuard no_grad;
  bool any = false;
  for (std::size_t g = 0; g < slots_.size(); ++g) {
    std::vector<Slot*> active;
    std::vector<at::Tensor> grads;
    for (auto& s : slots_[g]) {
      const at::Tensor& grad = s.param.grad();
      if (!grad.defined()) continue;
      if (s.state.empty()) init_state(s);
      active.push_back(&s);
      grads.push_back(
          grad.scalar_type() == s.master.scalar_type() ? grad : grad.to(s.master.scalar_type()));
    }
    if (active.empty()) continue;
    any = true;
    // The group's learning rate as one double product, lr * lr_mult, rounded once where the kernel
    // takes it (a double for the fused kernels on CPU, as for torch.optim's param groups).
    update(active, grads, lr * groups_[g].lr_mult, capturable() ? group_lr_[g] : at::Tensor(),
           groups_[g].weight_decay);
    for (Slot* s : active) {
      if (!s->master.is_same(s->param)) s->param.detach().copy_(s->master);
    }
  }
  if (any && !capturable()) ++steps_;
}

void Optimizer::set_capturable(c10::Device device) {
  PARALLAX_CHECK(fused(), ConfigError,
                 "key 'optim.fused': CUDA graph capture (train.cuda_graph) needs the fused "
                 "optimizer kernels, which "
                 "read the learning rate from device memory; set optim.fused=auto");
  // One tensor per distinct lr_mult (layer decay gives depth + 2 of them; rules a few more), which
  // the groups that share it read.
  group_lr_.clear();
  for (const auto& g : groups_) {
    at::Tensor& t = lr_tensors_[g.lr_mult];
    if (!t.defined()) t = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
    group_lr_.push_back(t);
  }
  if (lr_tensors_.empty())  // no group: still capturable (nothing to update)
    lr_tensors_[1.0] = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
}

void Optimizer::set_lr(double lr) {
  PARALLAX_CHECK(capturable(), Error, "Optimizer::set_lr() needs set_capturable() first");
  for (auto& [mult, t] : lr_tensors_) t.fill_(lr * mult);
}

void Optimizer::zero_grad(bool set_to_none) {
  at::NoGradGuard no_grad;
  for (auto& grp : slots_) {
    for (auto& s : grp) {
      at::Tensor& grad = s.param.mutable_grad();
      if (!grad.defined()) continue;
      if (set_to_none) {
        grad = at::Tensor();
      } else {
        // In place, so DDP's bucket views stay views (a gradient with a grad_fn, from a
        // create_graph backward, is replaced by its detached value first).
        if (grad.grad_fn()) grad = grad.detach();
        grad.zero_();
      }
    }
  }
}

std::vector<std::pair<std::string, at::Tensor>> Optimizer::state() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& grp : slots_) {
    for (auto& s : grp) {
      if (s.state.empty()) init_state(s);
      for (auto& [k, v] : s.state) out.emplace_back(s.name + "." + k, v);
      if (!s.master.is_same(s.param)) out.emplace_back(s.name + ".master", s.master);
    }
  }
  out.emplace_back("step", at::full({1}, static_cast<double>(steps_), at::kDouble));
  return out;
}

void Optimizer::load_state(const std::map<std::string, at::Tensor>& state) {
  at::NoGradGuard no_grad;
  auto fetch = [&](const std::string& key, at::Tensor& dst) {
    auto it = state.find(key);
    if (it == state.end()) throw_error<CheckpointError>("optimizer state '{}' is missing", key);
    if (it->second.sizes() != dst.sizes()) {
      throw_error<CheckpointError>("optimizer state '{}' has shape {}, expected {}", key,
                                   it->second.sizes(), dst.sizes());
    }
    dst.copy_(it->second);
  };
  for (auto& grp : slots_) {
    for (auto& s : grp) {
      if (s.state.empty()) init_state(s);
      for (auto& [k, v] : s.state) fetch(s.name + "." + k, v);
      if (!s.master.is_same(s.param)) fetch(s.name + ".master", s.master);
    }
  }
  auto it = state.find("step");
  if (it == state.end()) throw_error<CheckpointError>("optimizer state 'step' is missing");
  steps_ = static_cast<int64_t>(it->second.item<double>());
}

// ---- AdamW ------------------------------------------------------------------------------------

AdamW::AdamW(std::vector<ParamGroup> groups, double beta1, double beta2, double eps, bool fused)
    : Optimizer(std::move(groups)), beta1_(beta1), beta2_(beta2), eps_(eps), fused_(fused) {}

void AdamW::init_state(Slot& s) {
  s.state["exp_avg"] = at::zeros_like(s.master, at::MemoryFormat::Preserve);
  s.state["exp_avg_sq"] = at::zeros_like(s.master, at::MemoryFormat::Preserve);
  // A float32 tensor on the parameter's device, as the fused kernel expects (no host sync).
  s.state["step"] = at::zeros({}, s.master.options().dtype(at::kFloat));
}

void AdamW::update(std::vector<Slot*>& slots, std::vector<at::Tensor>& grads, double lr,
                   const at::Tensor& lr_tensor, double wd) {
  std::vector<at::Tensor> params, m, v, steps;
  for (Slot* s : slots) {
    params.push_back(s->master);
    m.push_back(s->state["exp_avg"]);
    v.push_back(s->state["exp_avg_sq"]);
    steps.push_back(s->state["step"]);
  }
  at::_foreach_add_(steps, 1.0);
  if (fused_) {
    if (lr_tensor.defined()) {
      at::_fused_adamw_(params, grads, m, v, {}, steps, lr_tensor, beta1_, beta2_, wd, eps_,
                        /*amsgrad=*/false,
                        /*maximize=*/false);
    } else {
      at::_fused_adamw_(params, grads, m, v, {}, steps, lr, beta1_, beta2_, wd, eps_,
                        /*amsgrad=*/false,
                        /*maximize=*/false);
    }
    return;
  }
  // Reference: PyTorch's single-tensor AdamW, op for op.
  for (std::size_t i = 0; i < params.size(); ++i) {
    const double step = steps[i].item<double>();
    params[i].mul_(1.0 - lr * wd);
    m[i].lerp_(grads[i], 1.0 - beta1_);
    v[i].mul_(beta2_).addcmul_(grads[i], grads[i], 1.0 - beta2_);
    const double bc1 = 1.0 - std::pow(beta1_, step);
    const double bc2 = 1.0 - std::pow(beta2_, step);
    const at::Tensor denom = (v[i].sqrt() / std::sqrt(bc2)).add_(eps_);
    params[i].addcdiv_(m[i], denom, -lr / bc1);
  }
}

// ---- SGD --------------------------------------------------------------------------------------

Sgd::Sgd(std::vector<ParamGroup> groups, double momentum, bool nesterov, bool fused)
    : Optimizer(std::move(groups)), momentum_(momentum), nesterov_(nesterov), fused_(fused) {}

void Sgd::init_state(Slot& s) {
  // Plain SGD (momentum 0) has no state; the fused kernel then wants no buffers at all.
  if (momentum_ != 0)
    s.state["momentum_buffer"] = at::zeros_like(s.master, at::MemoryFormat::Preserve);
}

void Sgd::update(std::vector<Slot*>& slots, std::vector<at::Tensor>& grads, double lr,
                 const at::Tensor& lr_tensor, double wd) {
  std::vector<at::Tensor> params, bufs;
  for (Slot* s : slots) {
    params.push_back(s->master);
    if (momentum_ != 0) bufs.push_back(s->state["momentum_buffer"]);
  }
  // Buffers start at zero, so the first step gives buf = grad exactly as PyTorch's
  // is_first_step path does (dampening is 0).
  if (fused_) {
    if (lr_tensor.defined()) {
      at::_fused_sgd_(params, grads, bufs, wd, momentum_, lr_tensor, /*dampening=*/0.0, nesterov_,
                      /*maximize=*/false, /*is_first_step=*/false);
    } else {
      at::_fused_sgd_(params, grads, bufs, wd, momentum_, lr, /*dampening=*/0.0, nesterov_,
                      /*maximize=*/false, /*is_first_step=*/false);
    }
    return;
  }
  for (std::size_t i = 0; i < params.size(); ++i) {
    at::Tensor d_p = wd != 0 ? grads[i].add(params[i], wd) : grads[i];
    if (momentum_ != 0) {
      bufs[i].mul_(momentum_).add_(d_p);
      d_p = nesterov_ ? d_p.add(bufs[i], momentum_) : bufs[i];
    }
    params[i].add_(d_p, -lr);
  }
}

std::unique_ptr<Optimizer> build_optimizer(const OptimConfig& cfg, std::vector<ParamGroup> groups) {
  const bool fused = cfg.fused != "off";
  if (cfg.name == "adamw") {
    return std::make_unique<AdamW>(std::move(groups), cfg.betas.at(0), cfg.betas.at(1), cfg.eps,
                                   fused);
  }
  if (cfg.name == "sgd")
    return std::make_unique<Sgd>(std::move(groups), cfg.momentum, cfg.nesterov, fused);
  throw_error<ConfigError>("key 'optim.name': unknown optimizer '{}' (use adamw|sgd)", cfg.name);
}

}  // namespace parallax::optim
