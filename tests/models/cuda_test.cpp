// The model zoo on CUDA: same results as on the CPU in fp32, bf16 autocast close to fp32, and a
// training step of bev/base at its benchmark scene. Skips where no GPU exists.
#include "kernels/bev_sample.h"
#include "models/camera_rig.h"
#include "models/geometry.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "models/view_transformer.h"
#include "tests/common/no_tf32.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <optional>
#include <string>
#include <vector>

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

using parallax::testing::NoTf32;

ModelConfig config(const std::string& name, const std::string& size, const std::string& backbone) {
  ModelConfig c;
  c.name = name;
  c.size = size;
  c.backbone = backbone;
  return c;
}

double rel_err(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kFloat).cpu() - b.to(at::kFloat).cpu()).abs().max() /
          b.abs().max().cpu().clamp_min(1e-12))
      .item<double>();
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
    EXPECT_NEAR(loss_gpu.total.item<double>(), loss_cpu.total.item<double>(),
                1e-3 * loss_cpu.total.item<double>());
    loss_gpu.total.backward();
    for (const auto& p : model->parameters())
      ASSERT_TRUE(p.grad().defined() && at::isfinite(p.grad()).all().item<bool>());
    const auto out = model->postprocess(pred_gpu);
    EXPECT_EQ(out.at("det_boxes").sizes(), at::IntArrayRef({2, 100, 9}));
    const double agree =
        (out.at("bev_labels").cpu() == model->postprocess(pred_cpu).at("bev_labels"))
            .to(at::kFloat)
            .mean()
            .item<double>();
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
  for (const auto& p : model->parameters())
    ASSERT_TRUE(p.grad().defined() && at::isfinite(p.grad()).all().item<bool>());
}

// ResNet-50 (frozen batch norm, FPN at stride 16) in the bev model: fp32 on CUDA agrees with the
// CPU (cuDNN's convolutions sum in another order: 1e-3 of the largest output, as for the conv
// backbone above), and bf16 autocast stays within 5% of fp32 (8 mantissa bits over 53 layers,
// the ViT bound above), with finite gradients for every trainable parameter.
TEST(ModelsCudaTest, ResNet50BevOnCudaMatchesCpuAndBf16IsClose) {
  SKIP_WITHOUT_CUDA();
  NoTf32 exact;
  core::SceneSpec scene;
  scene.num_cameras = 2;
  scene.image_height = 64;
  scene.image_width = 128;
  at::manual_seed(43);
  auto model = build_model(config("bev", "tiny", "resnet50"), scene);
  const auto batch = model->example_batch(2);
  const auto pred_cpu = model->forward(batch);
  model->to(at::kCUDA);
  const auto batch_gpu = core::to_device(batch, at::kCUDA);
  const auto pred_gpu = model->forward(batch_gpu);
  for (const char* key : {"bev_logits", "heatmap", "box_reg"})
    EXPECT_LT(rel_err(pred_gpu.at(key), pred_cpu.at(key)), 1e-3) << key;
  CudaAutocast autocast(at::kBFloat16);
  const auto pred = model->forward(batch_gpu);
  for (const char* key : {"bev_logits", "heatmap", "box_reg"})
    EXPECT_LT(rel_err(pred.at(key), pred_gpu.at(key)), 0.05) << key;
  auto loss = model->loss(batch_gpu, pred);
  ASSERT_TRUE(std::isfinite(loss.total.item<double>()));
  loss.total.backward();
  for (const auto& p : model->parameters()) {
    if (!p.requires_grad()) continue;
    ASSERT_TRUE(p.grad().defined() && at::isfinite(p.grad()).all().item<bool>());
  }
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
  for (const auto& p : model->parameters())
    ASSERT_TRUE(p.grad().defined() && at::isfinite(p.grad()).all().item<bool>());
}

TEST(ModelsCudaTest, ViewTransformerFusedSamplingMatchesAtenPath) {
  // The same view transformer (copied weights) with fused_kernels on (kernels::bev_sample's CUDA
  // kernels) and off (the compacted ATen sample()): B = 2, a jittered 6-camera surround rig, in
  // fp32 and under bf16 autocast with bf16 features (as the image encoder hands them over).
  SKIP_WITHOUT_CUDA();
  at::manual_seed(43);
  const int64_t b = 2, n = 6, h = 128, w = 224, stride = 8, c = 32;
  ViewTransformerOptions o;
  o.in_channels = o.channels = c;
  o.heights = {0.0, 0.67, 1.33, 2.0};
  o.grid = {-30, -30, 1.0, 60, 60};
  o.image_h = h;
  o.image_w = w;
  o.fused_kernels = true;
  ViewTransformer fused(o);
  o.fused_kernels = false;
  ViewTransformer plain(o);
  {
    at::NoGradGuard no_grad;
    const auto src = fused->parameters();
    const auto dst = plain->parameters();
    ASSERT_EQ(src.size(), dst.size());
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  fused->to(at::kCUDA);
  plain->to(at::kCUDA);
  const CameraRig rig = jitter_rig(make_surround_rig({n, h, w}), b);
  const at::Tensor k = rig.intrinsics.to(at::kCUDA), e = rig.cam_to_ego.to(at::kCUDA);
  const at::Tensor features = at::randn({b * n, c, h / stride, w / stride}, at::kCUDA);
  const at::Tensor weights = at::randn({b, c, o.grid.nx, o.grid.ny}, at::kCUDA);

  // The fused kernels must take these inputs, or the test would compare the ATen path with itself.
  const Projection proj = project_points(fused->reference_points(features.device()), k, e);
  const at::Tensor visible = visibility_mask(proj, h, w);
  ASSERT_TRUE(kernels::fused_bev_sample_supported(features, proj.uv, visible));
  ASSERT_TRUE(kernels::fused_bev_sample_supported(features.to(at::kBFloat16), proj.uv, visible));

  struct Result {
    at::Tensor out, grad_features;
    std::vector<at::Tensor> grad_params;
  };
  auto run = [&](ViewTransformer& vt, at::ScalarType dtype) {
    vt->zero_grad();
    at::Tensor f = features.to(dtype).clone().requires_grad_(true);  // a fresh leaf per run
    at::Tensor out;
    {
      std::optional<CudaAutocast> autocast;
      if (dtype != at::kFloat) autocast.emplace(dtype);
      out = vt->forward(f, k, e);
    }
    (out.to(at::kFloat) * weights).sum().backward();
    Result r{out.detach(), f.grad(), {}};
    for (const auto& p : vt->parameters()) r.grad_params.push_back(p.grad());
    return r;
  };

  // Tolerances, as max |difference| / max |reference|: fp32 (no TF32) differs only by the
  // sampling's fp32 summation order: 1e-5 on the output, 1e-4 on gradients (through GroupNorm).
  // bf16: the lifted inputs differ by at most one bf16 ulp where fp32 values straddle a rounding
  // boundary, and the bf16 convolutions' gradients by their own accumulation order: 2e-2 (a few
  // bf16 ulps of the largest element).
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    std::optional<NoTf32> exact;
    if (dtype == at::kFloat) exact.emplace();
    const Result a = run(fused, dtype), ref = run(plain, dtype);
    const double out_tol = dtype == at::kFloat ? 1e-5 : 2e-2,
                 grad_tol = dtype == at::kFloat ? 1e-4 : 2e-2;
    ASSERT_EQ(a.out.sizes(), at::IntArrayRef({b, c, o.grid.nx, o.grid.ny}));
    EXPECT_TRUE(at::isfinite(a.out).all().item<bool>());
    EXPECT_LT(rel_err(a.out, ref.out), out_tol);
    ASSERT_TRUE(a.grad_features.defined() && ref.grad_features.defined());
    EXPECT_EQ(a.grad_features.scalar_type(), dtype);
    EXPECT_GT(ref.grad_features.abs().max().item<double>(), 0.0);
    EXPECT_LT(rel_err(a.grad_features, ref.grad_features), grad_tol);
    const auto names = fused->named_parameters().keys();
    for (size_t i = 0; i < a.grad_params.size(); ++i) {
      ASSERT_TRUE(a.grad_params[i].defined() && ref.grad_params[i].defined()) << names[i];
      EXPECT_LT(rel_err(a.grad_params[i], ref.grad_params[i]), grad_tol) << names[i];
    }
  }
}

}  // namespace
}  // namespace parallax::models
