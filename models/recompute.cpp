#include "models/recompute.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

namespace parallax::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RngSnapshot {
  at::Tensor cpu;
  at::Tensor device;
  c10::Device dev{c10::kCPU};
};

RngSnapshot take_rng(const c10::Device& dev) {
  RngSnapshot s;
  auto cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    s.cpu = cpu.get_state();
  }
  if (dev.type() != c10::kCPU) {
    s.dev = dev;
    auto gen = at::globalContext().defaultGenerator(dev);
    std::lock_guard<std::mutex> lock(gen.mutex());
    s.device = gen.get_state();
  }
  return s;
}

void put_rng(const RngSnapshot& s) {
  auto cpu = at::detail::getDefaultCPUGenerator();
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_state(s.cpu);
  }
  if (s.device.defined()) {
    auto gen = at::globalContext().defaultGenerator(s.dev);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(s.device);
  }
}

struct RecomputeFunction : public torch::autograd::Function<RecomputeFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t block_ptr) {
    auto* block = reinterpret_cast<RecomputableBlock*>(block_ptr);
    const c10::DeviceType dt = x.device().type();
    const RngSnapshot rng = take_rng(x.device());
    ctx->saved_data["block"] = block_ptr;
    ctx->saved_data["cpu_rng"] = rng.cpu;
    if (rng.device.defined()) ctx->saved_data["dev_rng"] = rng.device;
    ctx->saved_data["autocast"] = at::autocast::is_autocast_enabled(dt);
    ctx->saved_data["autocast_dtype"] = static_cast<int64_t>(at::autocast::get_autocast_dtype(dt));
    ctx->save_for_backward({x});
    // Function::apply runs forward with grad recording off: nothing inside is saved.
    return block->forward_impl(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto* block = reinterpret_cast<RecomputableBlock*>(ctx->saved_data["block"].toInt());
    const at::Tensor saved = ctx->get_saved_variables()[0];
    const c10::DeviceType dt = saved.device().type();
    at::Tensor x = saved.detach().requires_grad_(saved.requires_grad());

    // Replay with the forward's RNG and autocast state, then put the current RNG state back so the
    // recomputation is invisible to the rest of training.
    RngSnapshot replay;
    replay.cpu = ctx->saved_data["cpu_rng"].toTensor();
    if (ctx->saved_data.count("dev_rng")) {
      replay.device = ctx->saved_data["dev_rng"].toTensor();
      replay.dev = saved.device();
    }
    at::Tensor out;
    {
      // Restores the current RNG and autocast state when the scope ends, also when the
      // recomputation throws (a CommError inside a tensor-parallel block, an OOM): the rest of
      // training must not continue with the forward's RNG stream or autocast setting.
      struct RestoreState {
        c10::DeviceType dt;
        RngSnapshot rng;
        bool autocast;
        at::ScalarType dtype;
        ~RestoreState() {
          at::autocast::set_autocast_enabled(dt, autocast);
          at::autocast::set_autocast_dtype(dt, dtype);
          put_rng(rng);
        }
      } restore{dt, take_rng(saved.device()), at::autocast::is_autocast_enabled(dt),
                at::autocast::get_autocast_dtype(dt)};
      put_rng(replay);
      at::autocast::set_autocast_enabled(dt, ctx->saved_data["autocast"].toBool());
      at::autocast::set_autocast_dtype(
          dt, static_cast<at::ScalarType>(ctx->saved_data["autocast_dtype"].toInt()));
      at::AutoGradMode grad_on(true);
      out = block->forward_impl(x);
    }
    if (out.requires_grad()) {
      // Reentrant backward: accumulates the block's parameter gradients and x.grad.
      torch::autograd::backward({out}, {grad_outputs[0]});
    }
    return {x.grad(), at::Tensor()};
  }
};

}  // namespace

at::Tensor run_recomputed(RecomputableBlock* block, const at::Tensor& x) {
  return RecomputeFunction::apply(x, reinterpret_cast<int64_t>(block));
}

at::Tensor RecomputableBlock::forward(const at::Tensor& x) {
  // The block's parameters are not inputs of the recompute function, so its output only requires
  // grad through x: without a grad-requiring input, run normally (nothing is saved anyway).
  if (recompute_ && is_training() && at::GradMode::is_enabled() && x.requires_grad()) {
    return run_recomputed(this, x);
  }
  return forward_impl(x);
}

}  // namespace parallax::models
