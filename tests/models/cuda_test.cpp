// The model zoo on CUDA: same results as on the CPU in fp32, bf16 autocast close to fp32, and a
// training step of bev/base at its benchmark scene. Skips where no GPU exists.
#include "models/model.h"
#include "models/perception_model.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

namespace parallax::models {
namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

// Enables CUDA autocast to `dtype` for its lifetime.
class CudaAutocast {
 public:
  explicit CudaAutocast(at::ScalarType dtype) {
    at::autocast::set_autocast_dtype(at::kCUDA, dtype);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
  }
  ~CudaAutocast() {
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
  }
};

// Exact fp32 on the GPU (no TF32) for the duration of a test.
class NoTf32 {
 public:
  NoTf32() : cudnn_(at::globalContext().allowTF32CuDNN()), cublas_(at::globalContext().allowTF32CuBLAS()) {
    at::globalContext().setAllowTF32CuDNN(false);
    at::globalContext().setAllowTF32CuBLAS(false);
  }
  ~NoTf32() {
    at::globalContext().setAllowTF32CuDNN(cudnn_);
    at::globalContext().setAllowTF32CuBLAS(cublas_);
  }

 private:
  bool cudnn_, cublas_;
};

ModelConfig config(const std::string& name, const std::string& size, const std::string& backbone) {
  ModelConfig c;
  c.name = name;
  c.size = size;
  c.backbone = backbone;
  return c;
}

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kFloat).cpu() - b.to(at::kFloat).cpu()).abs().max() / b.abs().max().cpu().clamp_min(1e-12)).item<double>();
}

TEST(ModelsCudaTest, BevTinyOnCudaMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  NoTf32 exact;
  for (const char* backbone : {"conv", "vit"}) {
    SCOPED_TRACE(backbone);
    at::manual_seed(40);
    auto model = build_model(config("bev", "tiny", backbone), core::SceneSpec{});
    const auto batch = model->example_batch(2);
    const auto pred_cpu = model->forward(batch);
    const auto loss_cpu = model->loss(batch, pred_cpu);
    model->to(at::kCUDA);
    const auto batch_gpu = core::to_device(batch, at::kCUDA);
    const auto pred_gpu = model->forward(batch_gpu);
    const auto loss_gpu = model->loss(batch_gpu, pred_gpu);
    for (const char* key : {"bev_logits", "heatmap", "box_reg"}) {
      ASSERT_TRUE(pred_gpu.at(key).is_cuda());
      EXPECT_LT(rel_err(pred_gpu.at(key), pred_cpu.at(key)), 1e-3) << key;
    }
    EXPECT_NEAR(loss_gpu.total.item<double>(), loss_cpu.total.item<double>(), 1e-3 * loss_cpu.total.item<double>());
    loss_gpu.total.backward();
    for (const auto& p : model->parameters()) ASSERT_TRUE(p.grad().defined() && at::isfinite(p.grad()).all().item<bool>());
    const auto out = model->postprocess(pred_gpu);
    EXPECT_EQ(out.at("det_boxes").sizes(), at::IntArrayRef({2, 100, 9}));
    const double agree = (out.at("bev_labels").cpu() == model->postprocess(pred_cpu).at("bev_labels")).to(at::kFloat).mean().item<double>();
    EXPECT_GT(agree, 0.999);
  }
}

TEST(ModelsCudaTest, VitClsBf16AutocastCloseToFp32) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(41);
  auto model = build_model(config("vit_cls", "b16", "vit"), core::SceneSpec{});
  model->to(at::kCUDA);
  const auto batch = core::to_device(model->example_batch(8), at::kCUDA);
  at::Tensor ref;
  {
    NoTf32 exact;
    ref = model->forward(batch).at("logits").detach();
  }
  CudaAutocast autocast(at::kBFloat16);
  const auto pred = model->forward(batch);
  EXPECT_EQ(pred.at("logits").scalar_type(), at::kBFloat16);
  EXPECT_LT(rel_err(pred.at("logits"), ref), 0.05);
  auto loss = model->loss(batch, pred);
  loss.total.backward();
  for (const auto& p : model->parameters()) ASSERT_TRUE(p.grad().defined() && at::isfinite(p.grad()).all().item<bool>());
}

TEST(ModelsCudaTest, BevBaseTrainingStepAtBenchmarkScene) {
  SKIP_WITHOUT_CUDA();
  at::manual_seed(42);
  const core::SceneSpec scene = benchmark_scene("base");
  auto model = build_model(config("bev", "base", "vit"), scene);
  const auto batch = core::to_device(model->example_batch(1), at::kCUDA);
  model->to(at::kCUDA);
  CudaAutocast autocast(at::kBFloat16);
  const auto pred = model->forward(batch);
  EXPECT_EQ(pred.at("bev_logits").sizes(), at::IntArrayRef({1, 6, 200, 200}));
  EXPECT_EQ(pred.at("heatmap").sizes(), at::IntArrayRef({1, 3, 200, 200}));
  auto loss = model->loss(batch, pred);
  ASSERT_TRUE(std::isfinite(loss.total.item<double>()));
  loss.total.backward();
  for (const auto& p : model->parameters()) ASSERT_TRUE(p.grad().defined() && at::isfinite(p.grad()).all().item<bool>());
}

}  // namespace
}  // namespace parallax::models
