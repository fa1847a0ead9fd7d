// The registry: every name builds, analytic costs agree with the built models, bad names throw.
#include "core/error.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "units/param_init.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace parallax::models {
namespace {

TEST(RegistryTest, MlpStandInKeepsWorkingAndMatchesItsAnalyticCost) {
  at::manual_seed(50);
  for (const char* size : {"tiny", "small"}) {
    ModelConfig cfg;
    cfg.name = "mlp";
    cfg.size = size;
    auto model = build_model(cfg, core::SceneSpec{});
    const auto costs = analytic_cost(cfg, core::SceneSpec{});
    ASSERT_EQ(costs.size(), 1u);
    EXPECT_EQ(costs[0].params, model->parameter_count());
    EXPECT_EQ(costs[0].flops,
              model->forward_flops_per_sample());  // the one cost, summed from 0: exact
    const auto batch = model->example_batch(3);
    const auto loss = model->loss(batch, model->forward(batch));
    EXPECT_TRUE(std::isfinite(loss.total.item<double>()));
    EXPECT_EQ(model->batch_size(batch), 3);
  }
}

TEST(RegistryTest, VitClsTinyMatchesItsAnalyticCostAndKeepsTheB16Interface) {
  // vit_cls tiny (the CPU size the ONNX export tests use): 224 x 224, patch 16, 2 blocks of dim 96.
  at::manual_seed(51);
  ModelConfig cfg;
  cfg.name = "vit_cls";
  cfg.size = "tiny";
  cfg.num_classes = 10;
  auto model = build_model(cfg, core::SceneSpec{});
  const auto costs = analytic_cost(cfg, core::SceneSpec{});
  int64_t params = 0;
  for (const auto& c : costs) params += c.params;
  EXPECT_EQ(params, model->parameter_count());
  // patch embedding + 197 position embeddings + class token + 2 blocks + final norm + head
  EXPECT_EQ(params,
            (3 * 16 * 16 * 96 + 96) + 197 * 96 + 96 +
                2 * (4 * 96 + 96 * 288 + 288 + 96 * 96 + 96 + 96 * 384 + 384 + 384 * 96 + 96) +
                2 * 96 + (96 * 10 + 10));
  const auto batch = model->example_batch(2);
  EXPECT_EQ(model->forward(batch).at("logits").sizes(), at::IntArrayRef({2, 10}));
  cfg.size = "small";
  EXPECT_THROW(build_model(cfg, core::SceneSpec{}), ConfigError);
}

TEST(RegistryTest, UnknownNamesAndSizesThrowConfigError) {
  ModelConfig cfg;
  cfg.name = "resnet";
  EXPECT_THROW(build_model(cfg, core::SceneSpec{}), ConfigError);
  EXPECT_THROW(analytic_cost(cfg, core::SceneSpec{}), ConfigError);
  cfg.name = "mlp";
  cfg.size = "3b";
  EXPECT_THROW(build_model(cfg, core::SceneSpec{}), ConfigError);
  cfg.name = "bev";
  cfg.size = "huge";
  EXPECT_THROW(analytic_cost(cfg, core::SceneSpec{}), ConfigError);
}

TEST(RegistryTest, LinearFactoryReachesEveryTransformerBlock) {
  int built = 0;
  ModelConfig cfg;
  cfg.name = "bev";
  cfg.size = "tiny";
  cfg.backbone = "vit";
  auto model = build_model(cfg, core::SceneSpec{}, [&](const LinearSpec& s) {
    ++built;
    return dense_linear(s);
  });
  EXPECT_EQ(built, 4 * 2);  // 4 linears in each of the 2 ViT blocks
  ModelConfig vit;
  vit.name = "vit_cls";
  vit.size = "b16";
  built = 0;
  build_model(vit, core::SceneSpec{}, [&](const LinearSpec& s) {
    ++built;
    return dense_linear(s);
  });
  EXPECT_EQ(built, 4 * 12);
}

// A zoo model of the construction tests below, with 10 classes.
struct BuildCase {
  const char* name;
  const char* size;
  const char* backbone;
};

ModelConfig config_of(const BuildCase& c) {
  ModelConfig cfg;
  cfg.name = c.name;
  cfg.size = c.size;
  cfg.backbone = c.backbone;
  cfg.num_classes = 10;
  return cfg;
}

// Shape-only construction (units/param_init.h, what `parallax plan` builds): the same parameters
// and buffers as a full build (names, shapes, dtypes, requires_grad, units, costs), none of them
// with storage.
TEST(RegistryTest, AShapeOnlyBuildHasTheFullBuildsTensorsAndHoldsNoStorage) {
  for (const BuildCase c : {BuildCase{"mlp", "tiny", "vit"}, BuildCase{"vit_cls", "tiny", "vit"},
                            BuildCase{"bev", "tiny", "vit"}, BuildCase{"bev", "tiny", "conv"},
                            BuildCase{"bev", "small", "vit"}}) {
    SCOPED_TRACE(std::string(c.name) + "/" + c.size + "/" + c.backbone);
    const ModelConfig cfg = config_of(c);
    const core::SceneSpec scene = benchmark_scene(cfg.name == "bev" ? c.size : "tiny");
    std::shared_ptr<Model> meta;
    {
      units::ShapeOnlyScope shape_only;
      EXPECT_TRUE(units::shape_only());
      meta = build_model(cfg, scene);
    }
    EXPECT_FALSE(units::shape_only());
    at::manual_seed(52);
    const auto full = build_model(cfg, scene);
    EXPECT_TRUE(units::is_shape_only(*meta));
    EXPECT_FALSE(units::is_shape_only(*full));
    const auto mp = meta->named_parameters(), fp = full->named_parameters();
    ASSERT_EQ(mp.size(), fp.size());
    for (std::size_t i = 0; i < mp.size(); ++i) {
      EXPECT_EQ(mp[i].key(), fp[i].key());
      EXPECT_EQ(mp[i].value().sizes(), fp[i].value().sizes()) << fp[i].key();
      EXPECT_EQ(mp[i].value().scalar_type(), fp[i].value().scalar_type()) << fp[i].key();
      EXPECT_EQ(mp[i].value().requires_grad(), fp[i].value().requires_grad()) << fp[i].key();
    }
    const auto mb = meta->named_buffers(), fb = full->named_buffers();
    ASSERT_EQ(mb.size(), fb.size());
    for (std::size_t i = 0; i < mb.size(); ++i) {
      EXPECT_EQ(mb[i].key(), fb[i].key());
      EXPECT_EQ(mb[i].value().sizes(), fb[i].value().sizes()) << fb[i].key();
    }
    const auto mu = meta->units(), fu = full->units();
    ASSERT_EQ(mu.size(), fu.size());
    for (std::size_t i = 0; i < mu.size(); ++i) EXPECT_EQ(mu[i].param_names, fu[i].param_names);
    EXPECT_EQ(meta->parameter_count(), full->parameter_count());
    EXPECT_EQ(meta->forward_flops_per_sample(), full->forward_flops_per_sample());
    EXPECT_EQ(meta->stage_costs(), full->stage_costs());
  }
}

// Deferred construction (units/param_init.h; ZeRO-3's parallel.meta_init): no parameter holds
// more than one element of storage, every parameter's and buffer's recipe gives bitwise the full
// build's value, in any order, and the generator ends where the full build leaves it (what the
// trainer draws next, LoRA adapters say, is unchanged).
TEST(RegistryTest, ADeferredBuildReplaysTheFullBuildsValuesBitwise) {
  for (const BuildCase c : {BuildCase{"mlp", "tiny", "vit"}, BuildCase{"vit_cls", "tiny", "vit"},
                            BuildCase{"bev", "tiny", "vit"}, BuildCase{"bev", "tiny", "conv"}}) {
    SCOPED_TRACE(std::string(c.name) + "/" + c.size + "/" + c.backbone);
    const ModelConfig cfg = config_of(c);
    const core::SceneSpec scene = benchmark_scene(cfg.name == "bev" ? c.size : "tiny");
    at::manual_seed(7);
    const auto full = build_model(cfg, scene);
    const at::Tensor after_full = at::randn({16});
    at::manual_seed(7);
    std::shared_ptr<Model> deferred;
    std::shared_ptr<units::DeferredInit> recipes;
    {
      units::DeferredInitScope scope;
      EXPECT_EQ(units::deferred_init(), scope.recipes().get());
      deferred = build_model(cfg, scene);
      recipes = scope.recipes();
    }
    EXPECT_EQ(units::deferred_init(), nullptr);
    EXPECT_TRUE(at::equal(at::randn({16}), after_full));
    const auto fp = full->named_parameters(), dp = deferred->named_parameters();
    ASSERT_EQ(fp.size(), dp.size());
    ASSERT_EQ(recipes->size(), fp.size() + full->named_buffers().size());
    at::manual_seed(99);  // values do not depend on the generator's state when they are asked for
    // Last to first: a recipe replays from its own state, not from where the previous one ended.
    for (std::size_t i = fp.size(); i-- > 0;) {
      const at::Tensor& d = dp[i].value();
      EXPECT_EQ(dp[i].key(), fp[i].key());
      EXPECT_EQ(d.sizes(), fp[i].value().sizes()) << fp[i].key();
      EXPECT_EQ(d.requires_grad(), fp[i].value().requires_grad()) << fp[i].key();
      EXPECT_LE(d.storage().nbytes(), static_cast<std::size_t>(d.element_size())) << fp[i].key();
      EXPECT_TRUE(at::equal(recipes->value(fp[i].key()), fp[i].value().detach())) << fp[i].key();
    }
    for (const auto& b : full->named_buffers())
      EXPECT_TRUE(at::equal(recipes->value(b.key()), b.value())) << b.key();
    // Placed on the CPU: buffers take their values in place; parameters stay placeholders.
    units::place_deferred(*deferred, *recipes, c10::Device(c10::kCPU));
    const auto fb = full->named_buffers(), db = deferred->named_buffers();
    for (std::size_t i = 0; i < fb.size(); ++i)
      EXPECT_TRUE(at::equal(db[i].value(), fb[i].value())) << fb[i].key();
    EXPECT_THROW(recipes->value("no.such.tensor"), Error);
  }
}

}  // namespace
}  // namespace parallax::models
