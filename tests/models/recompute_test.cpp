// Activation checkpointing (models/recompute.h): the recomputation in backward runs with the
// forward's RNG and autocast state and puts the caller's state back, also when it throws.
#include "models/recompute.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <stdexcept>

namespace parallax::models {
namespace {

// Linear + dropout; throws on the recomputation when `fail_recompute` is set.
class ScaleBlock : public RecomputableBlock {
 public:
  ScaleBlock() { w = register_parameter("w", at::randn({8, 8})); }
  at::Tensor forward_impl(const at::Tensor& x) override {
    if (++calls == 2 && fail_recompute) throw std::runtime_error("recomputation failed");
    return at::dropout(at::matmul(x, w), 0.5, /*train=*/true);
  }
  at::Tensor w;
  int calls = 0;
  bool fail_recompute = false;
};

at::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

TEST(CheckpointableTest, RecomputationMatchesTheForwardAndRestoresTheCallersState) {
  at::manual_seed(3);
  ScaleBlock plain, ckpt;
  ckpt.w.data().copy_(plain.w);
  ckpt.set_recompute(true);
  const at::Tensor x = at::randn({4, 8});
  const at::Tensor state = cpu_rng_state();
  at::Tensor xa = x.clone().requires_grad_(true);
  plain.forward(xa).sum().backward();
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
  at::Tensor xb = x.clone().requires_grad_(true);
  at::Tensor out = ckpt.forward(xb);
  const at::Tensor after_forward = cpu_rng_state();
  out.sum().backward();
  // Same dropout mask in the recomputation: bitwise-equal gradients (same ops, same order).
  EXPECT_TRUE(at::equal(plain.w.grad(), ckpt.w.grad()));
  EXPECT_TRUE(at::equal(xa.grad(), xb.grad()));
  EXPECT_EQ(ckpt.calls, 2);
  // The recomputation replayed the forward's RNG but left the caller's stream where it was.
  EXPECT_TRUE(at::equal(cpu_rng_state(), after_forward));
}

TEST(CheckpointableTest, AFailedRecomputationStillRestoresRngAndAutocast) {
  at::manual_seed(5);
  ScaleBlock block;
  block.set_recompute(true);
  block.fail_recompute = true;
  at::Tensor x = at::randn({4, 8}).requires_grad_(true);
  at::Tensor out;
  {
    // The forward runs under CPU autocast, so the recomputation turns autocast on.
    at::autocast::set_autocast_enabled(c10::kCPU, true);
    out = block.forward(x);
    at::autocast::set_autocast_enabled(c10::kCPU, false);
  }
  // Advance the caller's stream away from the forward's state the recomputation replays.
  (void)at::rand({16});
  const at::Tensor before = cpu_rng_state();
  EXPECT_THROW(out.sum().backward(), std::exception);
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  EXPECT_TRUE(at::equal(cpu_rng_state(), before));
}

}  // namespace
}  // namespace parallax::models
