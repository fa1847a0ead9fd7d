// The bev perception model: sizes, analytic costs against construction and the profiler, output
// shapes, the example batch contract, gradient flow and a tiny overfit run.
#include "core/error.h"
#include "models/camera_rig.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "tests/models/flop_profiler.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

namespace parallax::models {
namespace {

ModelConfig bev_config(const std::string& size, const std::string& backbone) {
  ModelConfig cfg;
  cfg.name = "bev";
  cfg.size = size;
  cfg.backbone = backbone;
  return cfg;
}

int64_t total_params(const std::vector<ModuleCost>& costs) {
  int64_t n = 0;
  for (const auto& c : costs) n += c.params;
  return n;
}

double total_flops(const std::vector<ModuleCost>& costs) {
  double f = 0;
  for (const auto& c : costs) f += c.flops;
  return f;
}

TEST(BevModelTest, AnalyticParameterCountsMatchConstruction) {
  at::manual_seed(30);
  for (const char* size : {"tiny", "small"}) {
    for (const char* backbone : {"vit", "conv"}) {
      SCOPED_TRACE(std::string(size) + "/" + backbone);
      const ModelConfig cfg = bev_config(size, backbone);
      auto model = std::dynamic_pointer_cast<PerceptionModel>(build_model(cfg, core::SceneSpec{}));
      ASSERT_TRUE(model);
      const auto costs = analytic_cost(cfg, core::SceneSpec{});
      EXPECT_EQ(model->parameter_count(), total_params(costs));
      // Component by component, against the constructed modules.
      ASSERT_EQ(costs.size(), 4u);
      EXPECT_EQ(costs[0].name, "backbone");
      EXPECT_EQ(count_parameters(*model->encoder()), costs[0].params);
      EXPECT_EQ(count_parameters(*model->view_transformer()), costs[1].params);
      // The same costs summed in the same order: exact.
      EXPECT_EQ(model->forward_flops_per_sample(), total_flops(costs));
    }
  }
}

TEST(BevModelTest, AnalyticCostsOfEverySizeIncluding3b) {
  // Analytic only: the 3b model is never allocated here.
  double prev_params = 0, prev_flops = 0;
  for (const char* size : {"tiny", "small", "base", "large", "3b"}) {
    const auto costs = analytic_cost(bev_config(size, "vit"), benchmark_scene(size));
    const double p = static_cast<double>(total_params(costs)), f = total_flops(costs);
    EXPECT_GT(p, prev_params) << size;
    EXPECT_GT(f, prev_flops) << size;
    prev_params = p;
    prev_flops = f;
  }
  EXPECT_NEAR(prev_params / 3e9, 1.0,
              0.1);  // 3b: a design target (3 billion within 10%), not rounding
  // base: the ViT-B/16 backbone (no class token, no head) dominates the parameters.
  const auto base = analytic_cost(bev_config("base", "vit"), benchmark_scene("base"));
  const int64_t vit_b = 86'567'656 - 768 /*cls*/ - 769'000 /*head*/ - 197 * 768 /*pos*/ +
                        16 * 44 * 768 /*pos 256x704*/;
  EXPECT_EQ(base[0].params, vit_b + 768 * 256 + 256 /*neck*/);
  EXPECT_EQ(benchmark_scene("base").bev_x_cells(), 200);
  EXPECT_EQ(make_bev_spec(bev_config("base", "vit"), benchmark_scene("base")).query_grid.nx, 200);
}

TEST(BevModelTest, ProfilerCountedFlopsMatchAnalyticCount) {
  at::manual_seed(31);
  for (const char* backbone : {"conv", "vit"}) {
    SCOPED_TRACE(backbone);
    auto model = std::dynamic_pointer_cast<PerceptionModel>(
        build_model(bev_config("tiny", backbone), core::SceneSpec{}));
    const auto batch = model->example_batch(1);
    torch::NoGradGuard no_grad;
    const double measured = testing::profiled_matmul_conv_flops([&] { model->forward(batch); });
    // Attention inside SDPA is invisible to the profiler: 2 blocks x 2 x 2 x T^2 x D per camera.
    const auto& vit = model->spec().encoder.vit;
    const double t = (128.0 / vit.patch) * (224.0 / vit.patch);
    const double attention =
        std::string(backbone) == "vit" ? 6 * vit.depth * 4.0 * t * t * vit.dim : 0.0;
    // Integer counts below 2^53 summed in double: exact.
    EXPECT_EQ(measured, model->forward_flops_per_sample() - attention);
  }
}

TEST(BevModelTest, ForwardShapesOfTinyAndSmall) {
  at::manual_seed(32);
  for (const char* size : {"tiny", "small"}) {
    SCOPED_TRACE(size);
    auto model = build_model(bev_config(size, "vit"), core::SceneSpec{});
    model->eval();
    const auto batch = model->example_batch(1);
    torch::NoGradGuard no_grad;
    const auto pred = model->forward(batch);
    const auto& spec = std::dynamic_pointer_cast<PerceptionModel>(model)->spec();
    const int64_t nx = spec.query_grid.nx;
    EXPECT_EQ(pred.at("bev_logits").sizes(), at::IntArrayRef({1, 6, 100, 100}));
    EXPECT_EQ(pred.at("heatmap").sizes(), at::IntArrayRef({1, 3, nx, nx}));
    EXPECT_EQ(pred.at("box_reg").sizes(), at::IntArrayRef({1, 8, nx, nx}));
    EXPECT_TRUE(at::isfinite(pred.at("bev_logits")).all().item<bool>());
    const auto out = model->postprocess(pred);
    EXPECT_EQ(out.at("bev_labels").sizes(), at::IntArrayRef({1, 100, 100}));
    EXPECT_EQ(out.at("bev_labels").scalar_type(), at::kLong);
    EXPECT_EQ(out.at("det_boxes").sizes(), at::IntArrayRef({1, 100, 9}));
    EXPECT_EQ(out.at("det_scores").sizes(), at::IntArrayRef({1, 100}));
  }
  EXPECT_EQ(std::dynamic_pointer_cast<PerceptionModel>(
                build_model(bev_config("tiny", "vit"), core::SceneSpec{}))
                ->spec()
                .query_grid.nx,
            50);
}

TEST(BevModelTest, ExampleBatchFollowsTheDataContract) {
  at::manual_seed(33);
  auto model = build_model(bev_config("tiny", "conv"), core::SceneSpec{});
  const auto b = model->example_batch(3);
  EXPECT_EQ(b.at("images").sizes(), at::IntArrayRef({3, 6, 128, 224, 3}));
  EXPECT_EQ(b.at("images").scalar_type(), at::kByte);
  EXPECT_EQ(b.at("intrinsics").sizes(), at::IntArrayRef({3, 6, 3, 3}));
  EXPECT_EQ(b.at("cam_to_ego").sizes(), at::IntArrayRef({3, 6, 4, 4}));
  EXPECT_EQ(b.at("bev_semantics").sizes(), at::IntArrayRef({3, 100, 100}));
  EXPECT_EQ(b.at("bev_semantics").scalar_type(), at::kLong);
  EXPECT_EQ(b.at("boxes").sizes(), at::IntArrayRef({3, 64, 9}));
  EXPECT_EQ(b.at("boxes").scalar_type(), at::kFloat);
  EXPECT_EQ(b.at("scene_index").sizes(), at::IntArrayRef({3}));
  const at::Tensor boxes = b.at("boxes"), cls = boxes.select(-1, 7);
  const at::Tensor valid = cls >= 0;
  const int64_t n_valid = valid.sum().item<int64_t>();
  EXPECT_GE(n_valid, 6);
  EXPECT_LE(n_valid, 24);
  // Padding rows come last and are class -1.
  for (int64_t s = 0; s < 3; ++s) {
    const int64_t k = valid[s].sum().item<int64_t>();
    EXPECT_TRUE(valid[s].narrow(0, 0, k).all().item<bool>());
  }
  const at::Tensor vis = boxes.select(-1, 8).masked_select(valid);
  EXPECT_GE(vis.min().item<float>(), 0.0f);
  EXPECT_LE(vis.max().item<float>(), 1.0f);
  EXPECT_GT(vis.mean().item<float>(), 0.3f);  // the surround rig sees most boxes
  // Each box's centre cell carries its class in the semantics (vehicle 3, pedestrian 4, cyclist 5),
  // unless a later box covers it.
  int64_t agree = 0;
  for (int64_t s = 0; s < 3; ++s) {
    for (int64_t k = 0; k < 64; ++k) {
      if (!valid[s][k].item<bool>()) continue;
      const int64_t i = static_cast<int64_t>((boxes[s][k][0].item<double>() + 25) / 0.5);
      const int64_t j = static_cast<int64_t>((boxes[s][k][1].item<double>() + 25) / 0.5);
      agree += b.at("bev_semantics")[s][i][j].item<int64_t>() == 3 + cls[s][k].item<int64_t>();
    }
  }
  EXPECT_GE(agree, n_valid - 2);
  EXPECT_TRUE((b.at("bev_semantics") == 1).any().item<bool>());  // road
}

TEST(BevModelTest, GradientsReachEveryParameter) {
  at::manual_seed(34);
  for (const char* backbone : {"conv", "vit"}) {
    SCOPED_TRACE(backbone);
    auto model = build_model(bev_config("tiny", backbone), core::SceneSpec{});
    const auto batch = model->example_batch(2);
    auto loss = model->loss(batch, model->forward(batch));
    ASSERT_TRUE(std::isfinite(loss.total.item<double>()));
    for (const char* term : {"seg_ce", "heatmap_focal", "box_l1"}) {
      ASSERT_TRUE(loss.terms.count(term)) << term;
      EXPECT_GT(loss.terms.at(term).item<double>(), 0.0) << term;
    }
    loss.total.backward();
    for (const auto& p : model->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_GT(p.value().grad().abs().sum().item<double>(), 0.0) << p.key();
    }
  }
}

// model.velocity: two more regression channels (counted by the analytic cost), velocities in the
// example batch, a velocity gradient on every head channel, and decoded velocities; the loss
// without the batch's "velocities" is the 8-entry loss.
TEST(BevModelTest, VelocityHeadTrainsAndDecodesVelocities) {
  at::manual_seed(36);
  ModelConfig cfg = bev_config("tiny", "conv");
  cfg.velocity = true;
  auto model = std::dynamic_pointer_cast<PerceptionModel>(build_model(cfg, core::SceneSpec{}));
  ASSERT_TRUE(model);
  const auto costs = analytic_cost(cfg, core::SceneSpec{});
  EXPECT_EQ(model->parameter_count(), total_params(costs));
  const auto plain = analytic_cost(bev_config("tiny", "conv"), core::SceneSpec{});
  // reg_out: 2 more output channels of a 1x1 conv from head_channels, with bias.
  EXPECT_EQ(total_params(costs) - total_params(plain), 2 * (model->spec().head_channels + 1));
  const auto batch = model->example_batch(2);
  ASSERT_TRUE(batch.count("velocities"));
  EXPECT_EQ(batch.at("velocities").sizes(), at::IntArrayRef({2, model->spec().scene.max_boxes, 2}));
  const auto pred = model->forward(batch);
  EXPECT_EQ(pred.at("box_reg").size(1), 10);
  auto loss = model->loss(batch, pred);
  ASSERT_TRUE(std::isfinite(loss.total.item<double>()));
  loss.total.backward();
  const at::Tensor g = model->named_parameters()["heads.reg_out.weight"].grad();
  ASSERT_TRUE(g.defined());
  EXPECT_GT(g.narrow(0, 8, 2).abs().sum().item<double>(), 0.0);
  // Without velocities in the batch the velocity channels get no gradient.
  model->zero_grad();
  core::TensorDict no_vel = batch;
  no_vel.erase("velocities");
  model->loss(no_vel, model->forward(no_vel)).total.backward();
  EXPECT_EQ(model->named_parameters()["heads.reg_out.weight"]
                .grad()
                .narrow(0, 8, 2)
                .abs()
                .sum()
                .item<double>(),
            0.0);
  const auto out = model->postprocess(pred);
  ASSERT_TRUE(out.count("det_velocities"));
  EXPECT_EQ(out.at("det_velocities").sizes(), at::IntArrayRef({2, 100, 2}));
  // The plain model decodes none.
  auto plain_model = build_model(bev_config("tiny", "conv"), core::SceneSpec{});
  EXPECT_FALSE(plain_model->postprocess(plain_model->forward(batch)).count("det_velocities"));
}

TEST(BevModelTest, CheckpointingEveryBlockGivesTheSameGradients) {
  at::manual_seed(35);
  auto model = build_model(bev_config("tiny", "vit"), core::SceneSpec{});
  const auto blocks = model->recomputable_blocks();
  ASSERT_EQ(blocks.size(), 2u + 2u);  // 2 ViT blocks + 2 BEV encoder blocks
  for (const auto& b : blocks) ASSERT_TRUE(std::dynamic_pointer_cast<Block>(b));
  const auto batch = model->example_batch(1);
  std::vector<at::Tensor> grads[2];
  double losses[2];
  for (int ckpt = 0; ckpt < 2; ++ckpt) {
    for (const auto& b : blocks) std::dynamic_pointer_cast<Block>(b)->set_recompute(ckpt == 1);
    model->zero_grad();
    auto loss = model->loss(batch, model->forward(batch));
    loss.total.backward();
    losses[ckpt] = loss.total.item<double>();
    for (const auto& p : model->parameters()) grads[ckpt].push_back(p.grad().clone());
  }
  // Exact by construction: the recomputation runs the same ops on the same inputs (the RNG state
  // restored), so the activations, the loss and each parameter's gradient are bitwise the same.
  EXPECT_EQ(losses[0], losses[1]);
  for (std::size_t i = 0; i < grads[0].size(); ++i) {
    EXPECT_TRUE(at::equal(grads[0][i], grads[1][i])) << i;
  }
}

TEST(BevModelTest, RejectsBadConfigsAndBatches) {
  EXPECT_THROW(build_model(bev_config("b16", "vit"), core::SceneSpec{}), ConfigError);
  core::SceneSpec odd;
  odd.image_width = 228;  // not divisible by the stride 8
  EXPECT_THROW(build_model(bev_config("tiny", "conv"), odd), ConfigError);
  EXPECT_THROW(analytic_cost(bev_config("tiny", "vit"), odd), ConfigError);
  auto model = build_model(bev_config("tiny", "conv"), core::SceneSpec{});
  auto batch = model->example_batch(1);
  batch["images"] = batch["images"].narrow(1, 0, 5);
  EXPECT_THROW(model->forward(batch), Error);
  batch.erase("images");
  EXPECT_THROW(model->forward(batch), Error);
}

TEST(BevModelTest, TinyOverfitsOneBatch) {
  at::manual_seed(36);
  // A smaller rig and BEV area than the dataset default keep the 30 steps cheap.
  core::SceneSpec scene;
  scene.image_height = 64;
  scene.image_width = 112;
  scene.x_min = scene.y_min = -16;
  scene.x_max = scene.y_max = 16;
  auto model = build_model(bev_config("tiny", "vit"), scene);
  const auto batch = model->example_batch(2);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0));
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    auto loss = model->loss(batch, model->forward(batch));
    loss.total.backward();
    opt.step();
    (step == 0 ? first : last) = loss.total.item<double>();
  }
  // Not a rounding tolerance: a training outcome. Measured: 5.95 -> 0.93 (0.16); the 0.3 leaves
  // about 2x for other CPUs' kernels; a broken head, target or gradient path stays far above.
  EXPECT_LT(last, 0.3 * first) << "first " << first << " last " << last;
}

}  // namespace
}  // namespace parallax::models
