// Activation checkpointing (models/recompute.h): identical gradients with and without it,
// dropout masks replayed, plain execution where nothing would be saved.
#include "models/recompute.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

using namespace parallax;

namespace {

class DropoutMlpBlock : public models::RecomputableBlock {
 public:
  DropoutMlpBlock() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 16));
    drop = register_module("drop", torch::nn::Dropout(0.3));
  }
  at::Tensor forward_impl(const at::Tensor& x) override { return x + fc2(drop(at::gelu(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};

}  // namespace

TEST(ActivationCheckpointTest, GradientsIdenticalWithAndWithoutCheckpointing) {
  at::manual_seed(5);
  auto b1 = std::make_shared<DropoutMlpBlock>();
  auto b2 = std::make_shared<DropoutMlpBlock>();
  auto stem = torch::nn::Linear(8, 16);
  const at::Tensor x = at::randn({4, 8});
  std::vector<at::Tensor> grads[2];
  for (int ckpt = 0; ckpt < 2; ++ckpt) {
    b1->set_recompute(ckpt == 1);
    b2->set_recompute(ckpt == 1);
    for (auto& p : b1->parameters()) p.mutable_grad() = at::Tensor();
    for (auto& p : b2->parameters()) p.mutable_grad() = at::Tensor();
    for (auto& p : stem->parameters()) p.mutable_grad() = at::Tensor();
    at::manual_seed(99);  // same dropout masks in both runs
    at::Tensor y = b2->forward(b1->forward(stem(x)));
    // Consume RNG between forward and backward: recomputation must replay the forward's masks.
    (void)at::rand({100});
    y.pow(2).sum().backward();
    for (auto& p : b1->parameters()) grads[ckpt].push_back(p.grad().clone());
    for (auto& p : b2->parameters()) grads[ckpt].push_back(p.grad().clone());
    for (auto& p : stem->parameters()) grads[ckpt].push_back(p.grad().clone());
  }
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (std::size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_TRUE(at::equal(grads[0][i], grads[1][i])) << "gradient " << i << " differs";
  }
}

TEST(ActivationCheckpointTest, NoGradForwardAndEvalRunPlainly) {
  auto b = std::make_shared<DropoutMlpBlock>();
  b->set_recompute(true);
  b->eval();
  const at::Tensor x = at::randn({2, 16}, at::requires_grad());
  EXPECT_TRUE(at::equal(b->forward(x), b->forward_impl(x)));
  at::NoGradGuard ng;
  EXPECT_FALSE(b->forward(x).requires_grad());
}
