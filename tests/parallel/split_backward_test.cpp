// zb's split backward (parallel/pipeline/split_backward.h) against autograd's whole backward on
// the same graph: the inputs' gradients (B) and the parameters' (W) are bitwise the whole
// backward's (each node runs the same kernels on the same gradients), and W does not run the
// activation path again (a node on it counts its backward calls: one, in B). On the CPU, and on
// CUDA where a GPU is present (the autograd engine's device threads and streams).
#include "parallel/pipeline/split_backward.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

using namespace parallax;
namespace pl = parallax::parallel::pipeline;

namespace {

int g_calls = 0;

// The identity, counting its backward calls.
struct Counted : public torch::autograd::Function<Counted> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    ++g_calls;
    return {g[0]};
  }
};

// A stage: LayerNorm, two Linears with a GELU between, a residual, a learned offset that only
// parameters reach (no input path), and a second output that does not depend on the input.
struct Stage {
  explicit Stage(c10::Device d) {
    norm->to(d);
    fc1->to(d);
    fc2->to(d);
    offset = at::randn({16}).to(d).set_requires_grad(true);
    bias2 = at::randn({16}).to(d).set_requires_grad(true);
  }
  torch::nn::LayerNorm norm{torch::nn::LayerNormOptions({16})};
  torch::nn::Linear fc1{16, 32}, fc2{32, 16};
  at::Tensor offset, bias2;
  std::vector<at::Tensor> params() {
    std::vector<at::Tensor> p{offset, bias2};
    for (auto* m : std::initializer_list<torch::nn::Module*>{norm.get(), fc1.get(), fc2.get()})
      for (auto& t : m->parameters()) p.push_back(t);
    return p;
  }
  std::vector<at::Tensor> forward(const at::Tensor& x) {
    at::Tensor h = Counted::apply(fc1(norm(x)));
    at::Tensor y = x + fc2(at::gelu(h)) + offset * 2;
    return {y, (bias2 * bias2).expand({4, 16})};
  }
};

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> g;
  for (const auto& p : ps) g.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return g;
}

class SplitBackwardTest : public ::testing::TestWithParam<c10::DeviceType> {
 protected:
  void SetUp() override {
    if (GetParam() == c10::kCUDA && !at::hasCUDA()) GTEST_SKIP() << "no GPU";
    at::globalContext().setAllowTF32CuBLAS(false);
  }
  c10::Device dev() const { return c10::Device(GetParam(), 0); }
};

}  // namespace

TEST_P(SplitBackwardTest, InputAndWeightPassesEqualTheWholeBackwardAndWalkTheActivationPathOnce) {
  at::manual_seed(3);
  Stage stage(dev());
  const at::Tensor x0 = at::randn({4, 16}).to(dev());
  const at::Tensor gy = at::randn({4, 16}).to(dev()), gz = at::randn({4, 16}).to(dev());
  const auto params = stage.params();

  // The whole backward.
  at::Tensor x = x0.clone().set_requires_grad(true);
  auto out = stage.forward(x);
  g_calls = 0;
  torch::autograd::backward(out, {gy, gz});
  EXPECT_EQ(g_calls, 1);
  const at::Tensor want_dx = x.grad().clone();
  const auto want = grads_of(params);
  for (auto p : params) p.mutable_grad() = at::Tensor();

  // B then W.
  at::Tensor x2 = x0.clone().set_requires_grad(true);
  auto out2 = stage.forward(x2);
  g_calls = 0;
  pl::SplitBackward split(out2, {gy, gz}, {x2}, params);
  EXPECT_EQ(g_calls, 1) << "B runs the activation path";
  ASSERT_EQ(split.input_grads().size(), 1u);
  EXPECT_TRUE(at::equal(split.input_grads()[0], want_dx));
  for (const auto& p : params) EXPECT_FALSE(p.grad().defined()) << "B accumulates no parameter";
  EXPECT_GT(split.boundary_nodes(), 0u);
  out2.clear();  // the pipeline drops the outputs after B
  split.weight_pass();
  EXPECT_EQ(g_calls, 1) << "W ran the activation path again";
  EXPECT_FALSE(x2.grad().defined()) << "W accumulates no input gradient";
  const auto got = grads_of(params);
  for (std::size_t k = 0; k < params.size(); ++k) {
    ASSERT_TRUE(got[k].defined()) << "parameter " << k;
    EXPECT_TRUE(at::equal(got[k], want[k])) << "parameter " << k;
  }
  EXPECT_THROW(split.weight_pass(), parallax::Error);
}

TEST_P(SplitBackwardTest, WithoutInputsWIsTheWholeBackwardFromALoss) {
  // The first stage: its inputs need no gradient, so B does nothing and W is the whole backward.
  at::manual_seed(4);
  Stage stage(dev());
  const at::Tensor x0 = at::randn({4, 16}).to(dev());
  const auto params = stage.params();
  auto loss_of = [&](const at::Tensor& x) {
    auto o = stage.forward(x);
    return (o[0] * o[0]).sum() + o[1].sum();
  };
  loss_of(x0).backward();
  const auto want = grads_of(params);
  for (auto p : params) p.mutable_grad() = at::Tensor();
  pl::SplitBackward split({loss_of(x0)}, {}, {x0}, params);
  EXPECT_EQ(split.input_path_nodes(), 0u);
  EXPECT_FALSE(split.input_grads()[0].defined());
  split.weight_pass();
  const auto got = grads_of(params);
  for (std::size_t k = 0; k < params.size(); ++k) EXPECT_TRUE(at::equal(got[k], want[k])) << k;
}

INSTANTIATE_TEST_SUITE_P(Devices, SplitBackwardTest, ::testing::Values(c10::kCPU, c10::kCUDA),
                         [](const auto& info) {
                           return std::string(info.param == c10::kCPU ? "cpu" : "cuda");
                         });
