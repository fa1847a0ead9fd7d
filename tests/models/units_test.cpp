// Model units (models/model.h): every model of the zoo lists units that cover its parameters
// exactly, calls the hooks once per unit in order, and keeps the ZeRO-3 contract: inside unit i's
// window the forward reads only unit i's parameters, outside every window (loss() included) it
// reads none, and a unit's backward needs only its own parameters once its outputs' gradient has
// arrived (with activation checkpointing too). Without hooks the forward is the one the
// submodules compose, bit for bit.
#include "core/error.h"
#include "kernels/fp8.h"
#include "models/backbone.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "models/temporal.h"
#include "models/vit.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace parallax::models {
namespace {

struct Case {
  std::string name, size, backbone;
  double dropout;
  int frames = 1;          // bev: model.temporal.frames
  bool prev_grad = false;  // bev: model.temporal.prev_grad
};

std::string label(const Case& c) {
  return c.name + "_" + c.size + (c.name == "bev" ? "_" + c.backbone : "") +
         (c.frames > 1 ? "_frames" + std::to_string(c.frames) + (c.prev_grad ? "_grad" : "") : "");
}

// Dropout > 0 where the model has dropout, so the comparisons below also cover the RNG stream.
const std::vector<Case> kTiny = {{"mlp", "tiny", "vit", 0.0},
                                 {"vit_cls", "tiny", "vit", 0.1},
                                 {"bev", "tiny", "vit", 0.1},
                                 {"bev", "tiny", "conv", 0.0},
                                 {"bev", "tiny", "resnet50", 0.0},
                                 // Temporal (models/temporal.h): the encoder and view units carry
                                 // the previous frame, the temporal unit fuses it.
                                 {"bev", "tiny", "conv", 0.0, 2, false},
                                 {"bev", "tiny", "conv", 0.0, 2, true}};

std::shared_ptr<Model> build(const Case& c) {
  ModelConfig cfg;
  cfg.name = c.name;
  cfg.size = c.size;
  cfg.backbone = c.backbone;
  cfg.dropout = c.dropout;
  cfg.temporal.frames = c.frames;
  cfg.temporal.prev_grad = c.prev_grad;
  core::SceneSpec scene;
  if (c.backbone.rfind("resnet", 0) == 0) {
    // ResNet-50 on 2 cameras of 64 x 128 (2.7 GFLOPs forward per sample): cheap enough for CI.
    scene.num_cameras = 2;
    scene.image_height = 64;
    scene.image_width = 128;
  }
  return build_model(cfg, scene);
}

void set_recompute(Model& model, bool on) {
  for (const auto& b : model.recomputable_blocks()) {
    auto block = std::dynamic_pointer_cast<RecomputableBlock>(b);
    ASSERT_TRUE(block);
    block->set_recompute(on);
  }
}

// Records "b<i>" / "a<i>" and the outputs of every after_unit.
class RecordingHooks : public UnitHooks {
 public:
  void before_unit(int index) override { events.push_back(fmt::format("b{}", index)); }
  void after_unit(int index, const std::vector<at::Tensor>& outputs) override {
    events.push_back(fmt::format("a{}", index));
    last_outputs = outputs;
  }
  std::vector<std::string> events;
  std::vector<at::Tensor> last_outputs;
};

std::vector<std::string> expected_events(std::size_t units) {
  std::vector<std::string> e;
  for (std::size_t i = 0; i < units; ++i) {
    e.push_back(fmt::format("b{}", i));
    e.push_back(fmt::format("a{}", i));
  }
  return e;
}

// ZeRO-3 in miniature, with NaN for "not gathered": every parameter is NaN except those of the
// unit inside its window (before_unit .. after_unit). In backward, a hook on a unit's outputs
// brings the unit's parameters back when their gradient arrives (ZeRO-3's re-gather before the
// unit's backward); earlier units stay NaN until theirs arrives. Any read of a parameter outside
// these rules puts a NaN into the outputs, the loss or the gradients.
class NanOutsideWindow : public UnitHooks {
 public:
  explicit NanOutsideWindow(Model& model) : units_(model.units()) {
    const auto named = model.named_parameters();
    torch::NoGradGuard no_grad;
    for (const Unit& u : units_) {
      std::vector<Param> params;
      for (const auto& name : u.param_names) {
        const at::Tensor& p = named[name];
        params.push_back({p, p.data(), at::full_like(p, std::numeric_limits<double>::quiet_NaN())});
      }
      params_.push_back(std::move(params));
    }
    restored_.assign(units_.size(), false);
    show(-1);
  }
  ~NanOutsideWindow() override { restore_all(); }

  void before_unit(int index) override {
    EXPECT_EQ(index, next_) << "units out of order";
    next_ = index + 1;
    show(index);
  }
  void after_unit(int index, const std::vector<at::Tensor>& outputs) override {
    show(-1);
    for (const at::Tensor& out : outputs) {
      if (out.requires_grad())
        out.register_hook([this, index](const at::Tensor&) { restore(index); });
    }
  }

  void restore_all() {
    for (std::size_t u = 0; u < units_.size(); ++u) restore(static_cast<int>(u));
  }
  const std::vector<bool>& restored() const { return restored_; }

 private:
  struct Param {
    at::Tensor param, real, nan;
  };
  // Unit `index`'s parameters real, every other NaN (index -1: all NaN).
  void show(int index) {
    torch::NoGradGuard no_grad;
    for (std::size_t u = 0; u < params_.size(); ++u) {
      for (Param& p : params_[u]) p.param.set_data(static_cast<int>(u) == index ? p.real : p.nan);
    }
  }
  void restore(int index) {
    torch::NoGradGuard no_grad;
    for (Param& p : params_[index]) p.param.set_data(p.real);
    restored_[index] = true;
  }

  std::vector<Unit> units_;
  std::vector<std::vector<Param>> params_;
  std::vector<bool> restored_;
  int next_ = 0;
};

bool same_dicts(const core::TensorDict& a, const core::TensorDict& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a) {
    if (!b.count(k) || !at::equal(v, b.at(k))) return false;
  }
  return true;
}

TEST(UnitsTest, EveryParameterIsInExactlyOneNonEmptyUniquelyNamedUnit) {
  std::vector<Case> cases = kTiny;
  cases.push_back({"mlp", "small", "vit", 0.0});
  cases.push_back({"bev", "small", "vit", 0.0});
  cases.push_back({"bev", "small", "conv", 0.0});
  for (const Case& c : cases) {
    SCOPED_TRACE(label(c));
    auto model = build(c);
    const std::vector<Unit> units = model->units();
    ASSERT_GT(units.size(), 1u);
    std::set<std::string> names;
    std::map<std::string, int> owners;
    for (const Unit& u : units) {
      EXPECT_TRUE(names.insert(u.name).second) << "two units named " << u.name;
      EXPECT_FALSE(u.param_names.empty()) << "empty unit " << u.name;
      for (const auto& p : u.param_names) ++owners[p];
    }
    const auto named = model->named_parameters();
    EXPECT_EQ(owners.size(), named.size());
    std::map<std::string, std::size_t> position;
    for (const auto& item : named) {
      EXPECT_EQ(owners[item.key()], 1) << item.key();
      position[item.key()] = position.size();
    }
    // Each unit lists its names in registration order.
    for (const Unit& u : units) {
      for (std::size_t k = 1; k < u.param_names.size(); ++k) {
        EXPECT_LT(position.at(u.param_names[k - 1]), position.at(u.param_names[k])) << u.name;
      }
    }
  }
}

TEST(UnitsTest, UnitNamesFollowTheModulePaths) {
  auto names = [](const Case& c) {
    std::vector<std::string> out;
    for (const Unit& u : build(c)->units()) out.push_back(u.name);
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(names(kTiny[0]), (V{"net.0", "net.2", "net.4"}));
  EXPECT_EQ(names(kTiny[1]), (V{"vit.embed", "vit.block0", "vit.block1", "head"}));
  EXPECT_EQ(names(kTiny[2]), (V{"encoder.vit.embed", "encoder.vit.block0", "encoder.vit.block1",
                                "encoder.neck", "view", "bev_block0", "bev_block1", "heads"}));
  EXPECT_EQ(names(kTiny[3]), (V{"encoder", "view", "bev_block0", "bev_block1", "heads"}));
  EXPECT_EQ(names(kTiny[4]),
            (V{"encoder.resnet.layer1", "encoder.resnet.layer2", "encoder.resnet.layer3",
               "encoder.fpn", "view", "bev_block0", "bev_block1", "heads"}));
  // The small position parameters sit with the layers that read them.
  const auto vit = build(kTiny[1])->units();
  EXPECT_EQ(vit.front().param_names, (V{"vit.cls_token", "vit.pos_embed", "vit.patch_embed.weight",
                                        "vit.patch_embed.bias"}));
  EXPECT_EQ(vit.back().param_names,
            (V{"vit.norm.weight", "vit.norm.bias", "head.weight", "head.bias"}));
  const auto bev = build(kTiny[2])->units();
  EXPECT_EQ(bev[3].param_names, (V{"encoder.vit.norm.weight", "encoder.vit.norm.bias",
                                   "encoder.neck.weight", "encoder.neck.bias"}));
  EXPECT_EQ(bev[4].param_names.front(), "view.query_embed");
}

TEST(UnitsTest, HooksAreCalledOncePerUnitInOrderAndPaired) {
  for (const Case& c : kTiny) {
    SCOPED_TRACE(label(c));
    at::manual_seed(41);
    auto model = build(c);
    const core::TensorDict batch =
        model->example_batch(1);  // one sample: fast, and every check is elementwise
    const std::size_t n = model->units().size();
    RecordingHooks hooks;
    model->set_unit_hooks(&hooks);
    EXPECT_EQ(model->unit_hooks(), &hooks);
    core::TensorDict pred = model->forward(batch);
    EXPECT_EQ(hooks.events, expected_events(n));
    // The last unit returns the predictions themselves.
    for (const auto& [key, t] : pred) {
      bool found = false;
      for (const auto& o : hooks.last_outputs) found = found || o.is_same(t);
      EXPECT_TRUE(found) << key << " is not an output of the last unit";
    }
    // A second forward (eval mode, no grad) calls them again, the same way.
    hooks.events.clear();
    model->eval();
    {
      at::NoGradGuard no_grad;
      (void)model->forward(batch);
    }
    EXPECT_EQ(hooks.events, expected_events(n));
    hooks.events.clear();
    model->set_unit_hooks(nullptr);
    (void)model->forward(batch);
    EXPECT_TRUE(hooks.events.empty());
  }
}

// Outputs, loss and gradients of a training step; `hooks` installed around the forward and the
// backward (nullptr: none). Reseeds, so dropout draws the same masks in every call.
struct Step {
  core::TensorDict pred;
  at::Tensor loss;
  std::map<std::string, at::Tensor> grads;
};

Step train_step(Model& model, const core::TensorDict& batch, UnitHooks* hooks) {
  model.zero_grad();
  model.train();
  model.set_unit_hooks(hooks);
  at::manual_seed(7);
  Step s;
  s.pred = model.forward(batch);
  s.loss = model.loss(batch, s.pred).total;
  s.loss.backward();
  model.set_unit_hooks(nullptr);
  for (const auto& item : model.named_parameters()) {
    s.grads[item.key()] =
        item.value().grad().defined() ? item.value().grad().clone() : at::Tensor();
  }
  return s;
}

TEST(UnitsTest, EachUnitReadsOnlyItsOwnParametersInsideItsWindow) {
  for (const Case& c : kTiny) {
    for (const bool ckpt : {false, true}) {
      SCOPED_TRACE(label(c) + (ckpt ? " checkpointed" : ""));
      at::manual_seed(43);
      auto model = build(c);
      if (ckpt && model->recomputable_blocks().empty()) continue;
      set_recompute(*model, ckpt);
      const core::TensorDict batch =
          model->example_batch(1);  // one sample: fast, and every check is elementwise
      const Step plain = train_step(*model, batch, nullptr);
      ASSERT_TRUE(at::isfinite(plain.loss).item<bool>());

      NanOutsideWindow nan(*model);
      const Step guarded = train_step(*model, batch, &nan);
      // Same ops on the same values in the same order: bitwise.
      EXPECT_TRUE(same_dicts(guarded.pred, plain.pred))
          << "a unit read another unit's parameters in its window";
      EXPECT_TRUE(at::equal(guarded.loss, plain.loss))
          << "the loss differs (a NaN from the forward, or loss() read a parameter)";
      for (std::size_t u = 0; u < nan.restored().size(); ++u)
        EXPECT_TRUE(nan.restored()[u]) << "unit " << u;
      for (const auto& [name, g] : plain.grads) {
        ASSERT_TRUE(g.defined()) << name << " has no gradient";
        EXPECT_TRUE(at::equal(guarded.grads.at(name), g))
            << name << ": a backward read a parameter not gathered";
      }
    }
  }
}

// The forward before units existed, composed from the submodules' own forward().
core::TensorDict composed_forward(const Case& c, Model& model, const core::TensorDict& batch) {
  auto children = model.named_children();
  if (c.name == "mlp") {
    return {{"y_hat", std::dynamic_pointer_cast<torch::nn::SequentialImpl>(children["net"])
                          ->forward(batch.at("x"))}};
  }
  if (c.name == "vit_cls") {
    auto vit = std::dynamic_pointer_cast<VisionTransformerImpl>(children["vit"]);
    auto head = std::dynamic_pointer_cast<DenseLinearImpl>(children["head"]);
    return {{"logits",
             head->forward(
                 vit->forward(normalize_images(batch.at("images"), at::kFloat)).select(1, 0))}};
  }
  auto& bev = dynamic_cast<PerceptionModel&>(model);
  const at::Tensor& im = batch.at("images");
  at::Tensor x =
      im.reshape({im.size(0) * im.size(1), im.size(2), im.size(3), 3}).permute({0, 3, 1, 2});
  x = bev.encoder()->forward(normalize_images(x, at::kFloat));
  x = bev.view_transformer()->forward(x, batch.at("intrinsics"), batch.at("cam_to_ego"));
  if (bev.spec().frames > 1) {
    // The previous frames through the same encoder and view, aligned, then fused.
    const at::Tensor& pi = batch.at("prev_images");
    at::Tensor p = pi.reshape({-1, pi.size(3), pi.size(4), 3}).permute({0, 3, 1, 2});
    p = bev.encoder()->forward(normalize_images(p, at::kFloat));
    const at::Tensor& k = batch.at("prev_intrinsics");
    const at::Tensor& e = batch.at("prev_cam_to_ego");
    p = bev.view_transformer()->forward(p, k.reshape({-1, k.size(2), 3, 3}),
                                        e.reshape({-1, e.size(2), 4, 4}));
    const at::Tensor aligned =
        align_bev(p, batch.at("prev_to_current").reshape({-1, 4, 4}), bev.spec().query_grid);
    x = std::dynamic_pointer_cast<TemporalFusionImpl>(children["temporal"])
            ->forward(x, aligned.view(
                             {x.size(0), bev.spec().frames - 1, x.size(1), x.size(2), x.size(3)}));
  }
  for (int64_t i = 0; i < bev.spec().encoder_blocks; ++i) {
    x = std::dynamic_pointer_cast<ResidualConvBlock>(children["bev_block" + std::to_string(i)])
            ->forward(x);
  }
  core::TensorDict h = std::dynamic_pointer_cast<BevHeadsImpl>(children["heads"])->forward(x);
  const BevGrid lg = bev.spec().label_grid();
  at::Tensor seg = h.at("seg");
  if (seg.size(2) != lg.nx || seg.size(3) != lg.ny)
    seg = at::upsample_bilinear2d(seg, {lg.nx, lg.ny}, false);
  return {{"bev_logits", seg}, {"heatmap", h.at("heatmap")}, {"box_reg", h.at("box_reg")}};
}

TEST(UnitsTest, ForwardWithoutHooksIsTheComposedForwardBitForBit) {
  for (const Case& c : kTiny) {
    SCOPED_TRACE(label(c));
    at::manual_seed(47);
    auto model = build(c);
    const core::TensorDict batch =
        model->example_batch(1);  // one sample: fast, and every check is elementwise
    model->train();
    at::manual_seed(9);
    const core::TensorDict units = model->forward(batch);
    at::manual_seed(9);
    const core::TensorDict composed = composed_forward(c, *model, batch);
    EXPECT_TRUE(same_dicts(units, composed));
    // Hooks that do nothing change nothing.
    RecordingHooks hooks;
    model->set_unit_hooks(&hooks);
    at::manual_seed(9);
    EXPECT_TRUE(same_dicts(model->forward(batch), units));
    model->set_unit_hooks(nullptr);
  }
}

TEST(UnitsTest, CheckpointedBlocksWithHooksGiveTheGradientsWithout) {
  at::manual_seed(53);
  auto model = build(kTiny[2]);  // bev tiny, ViT backbone: transformer and conv blocks
  set_recompute(*model, true);
  const core::TensorDict batch =
      model->example_batch(1);  // one sample: fast, and every check is elementwise
  const Step plain = train_step(*model, batch, nullptr);
  RecordingHooks hooks;
  const Step hooked = train_step(*model, batch, &hooks);
  // The recomputation in backward does not call the hooks again.
  EXPECT_EQ(hooks.events, expected_events(model->units().size()));
  EXPECT_TRUE(at::equal(hooked.loss, plain.loss));
  for (const auto& [name, g] : plain.grads)
    EXPECT_TRUE(at::equal(hooked.grads.at(name), g)) << name;
}

// ---- resolve_units and the default ------------------------------------------------------------

struct TwoLayers : torch::nn::Module {
  TwoLayers() {
    a = register_module("a", torch::nn::Linear(4, 4));
    ab = register_module("ab", torch::nn::Linear(4, 4));
    scale = register_parameter("scale", at::ones({1}));
  }
  torch::nn::Linear a{nullptr}, ab{nullptr};
  at::Tensor scale;
};

TEST(UnitsTest, ResolveUnitsMatchesWholePathSegmentsAndRejectsBadCovers) {
  TwoLayers m;
  const auto units = resolve_units(m, {{"first", {"a", "scale"}}, {"second", {"ab"}}});
  ASSERT_EQ(units.size(), 2u);
  // "a" does not swallow "ab.*".
  EXPECT_EQ(units[0].param_names, (std::vector<std::string>{"scale", "a.weight", "a.bias"}));
  EXPECT_EQ(units[1].param_names, (std::vector<std::string>{"ab.weight", "ab.bias"}));
  auto message = [&](const std::vector<UnitPaths>& specs) {
    try {
      (void)resolve_units(m, specs);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({{"first", {"a"}}, {"second", {"ab"}}}).find("'scale' is in no unit"),
            std::string::npos);
  EXPECT_NE(message({{"first", {"a", "scale"}}, {"second", {"ab", "a.bias"}}})
                .find("'a.bias' is in two units"),
            std::string::npos);
  EXPECT_NE(message({{"first", {"a", "ab", "scale"}}, {"second", {"b"}}})
                .find("'second' owns no parameter"),
            std::string::npos);
  EXPECT_NE(message({{"x", {"a", "scale"}}, {"x", {"ab"}}}).find("two units are named 'x'"),
            std::string::npos);
}

// A model that does not override units(): one unit "model", run around its whole forward.
class OneUnitModel : public Model {
 public:
  OneUnitModel() { w_ = register_parameter("w", at::randn({3, 3})); }
  core::TensorDict forward(const core::TensorDict& batch) override {
    return {
        {"y", run_unit(0, [&] { return std::vector<at::Tensor>{batch.at("x").matmul(w_)}; })[0]}};
  }
  LossOutput loss(const core::TensorDict&, const core::TensorDict& pred) override {
    return {pred.at("y").sum(), {}};
  }
  double forward_flops_per_sample() const override { return 18; }
  int64_t batch_size(const core::TensorDict& batch) const override { return batch.at("x").size(0); }
  core::TensorDict example_batch(int64_t n) const override { return {{"x", at::randn({n, 3})}}; }

 private:
  at::Tensor w_;
};

TEST(UnitsTest, DefaultIsOneUnitHoldingEveryParameter) {
  OneUnitModel model;
  const auto units = model.units();
  ASSERT_EQ(units.size(), 1u);
  EXPECT_EQ(units[0].name, "model");
  EXPECT_EQ(units[0].param_names, std::vector<std::string>{"w"});
  EXPECT_EQ(model.unit_hooks(), nullptr);
  RecordingHooks hooks;
  model.set_unit_hooks(&hooks);
  const core::TensorDict pred = model.forward(model.example_batch(2));
  EXPECT_EQ(hooks.events, expected_events(1));
  ASSERT_EQ(hooks.last_outputs.size(), 1u);
  EXPECT_TRUE(hooks.last_outputs[0].is_same(pred.at("y")));
}

}  // namespace
}  // namespace parallax::models

namespace parallax::models {
namespace {

// The chain (pipeline stages) has one link per unit, and forward() is that chain: the same outputs
// bitwise as running chain_begin / run_chain / chain_end by hand, in two halves.
TEST(UnitsTest, TheChainHasOneLinkPerUnitAndIsTheForward) {
  for (const auto& c : kTiny) {
    SCOPED_TRACE(label(c));
    auto model = build(c);
    model->eval();
    const int n = model->chain_length();
    ASSERT_EQ(n, static_cast<int>(model->units().size()));
    at::manual_seed(3);
    const core::TensorDict batch = model->example_batch(2);
    const core::TensorDict whole = model->forward(batch);
    const int cut = n / 2;
    std::vector<at::Tensor> mid = model->run_chain(0, cut, batch, model->chain_begin(batch));
    for (auto& t : mid) t = t.detach().clone();  // as a stage boundary passes it
    const core::TensorDict split = model->chain_end(batch, model->run_chain(cut, n, batch, mid));
    ASSERT_EQ(whole.size(), split.size());
    for (const auto& [k, v] : whole) EXPECT_TRUE(at::equal(v, split.at(k))) << k;
    EXPECT_THROW(model->run_chain(0, n + 1, batch, {}), Error);
  }
}

// The bev model's FLOPs per unit (pipeline balance) cover its forward FLOPs exactly.
TEST(UnitsTest, BevUnitFlopsSumToTheForwardFlops) {
  for (const Case& c :
       {Case{"bev", "tiny", "vit", 0.0}, Case{"bev", "tiny", "conv", 0.0},
        Case{"bev", "tiny", "resnet50", 0.0}, Case{"bev", "tiny", "conv", 0.0, 3}}) {
    SCOPED_TRACE(label(c));
    auto model = build(c);
    const std::vector<double> f = model->unit_flops();
    ASSERT_EQ(f.size(), model->units().size());
    double sum = 0;
    for (double x : f) {
      EXPECT_GT(x, 0);
      sum += x;
    }
    EXPECT_NEAR(sum, model->forward_flops_per_sample(), 1e-9 * sum);
  }
}

// FP8 linear layers (precision.mode=fp8) inside checkpointed blocks: the recomputation in backward
// casts the same tensors with the same scales (current recipe: the same amaxes; delayed: the same
// history, which only roll_histories() changes, and re-recording an amax is a MAX, so idempotent),
// so the outputs, every gradient and the delayed recipe's recorded amaxes are those of the run
// without checkpointing, bit for bit; also after a roll, when the scales come from the history.
// On the CPU the layers run ATen's composition and ATen's CPU _scaled_mm.
TEST(UnitsTest, Fp8LayersInCheckpointedBlocksMatchTheRunWithoutCheckpointing) {
  // vit_cls (dropout 0.1, so the recomputation's RNG replay is covered too); bev's ViT backbone
  // has the same blocks.
  for (const Case& c : {kTiny[1]}) {
    for (const auto recipe : {kernels::fp8::Recipe::kCurrent, kernels::fp8::Recipe::kDelayed}) {
      SCOPED_TRACE(label(c) + " " + kernels::fp8::to_string(recipe));
      kernels::fp8::Fp8Options o;
      o.recipe = recipe;
      o.amax_history = 4;
      std::vector<std::shared_ptr<Model>> models;
      for (const bool ckpt : {false, true}) {
        at::manual_seed(43);
        models.push_back(build(c));
        ASSERT_GT(enable_fp8(*models.back(), o), 0);
        set_recompute(*models.back(), ckpt);
      }
      const core::TensorDict batch = models[0]->example_batch(1);
      for (int step = 0; step < 2; ++step) {
        std::vector<Step> s;
        for (auto& m : models) {
          m->zero_grad();
          s.push_back(train_step(*m, batch, nullptr));
        }
        EXPECT_TRUE(same_dicts(s[0].pred, s[1].pred)) << "step " << step;
        EXPECT_TRUE(at::equal(s[0].loss, s[1].loss)) << "step " << step;
        for (const auto& [name, g] : s[0].grads) {
          ASSERT_TRUE(g.defined()) << name;
          EXPECT_TRUE(at::equal(s[1].grads.at(name), g)) << name << " step " << step;
        }
        const auto a = kernels::fp8::fp8_layers(*models[0]),
                   b = kernels::fp8::fp8_layers(*models[1]);
        ASSERT_EQ(a.size(), b.size());
        for (std::size_t i = 0; i < a.size(); ++i) {
          if (recipe == kernels::fp8::Recipe::kDelayed) {
            EXPECT_TRUE(at::equal(a[i]->step_amax, b[i]->step_amax)) << "layer " << i;
            EXPECT_GT(a[i]->step_amax.min().item<float>(), 0)
                << "layer " << i << " recorded nothing";
          }
        }
        kernels::fp8::roll_histories(a, {});
        kernels::fp8::roll_histories(b, {});
        for (std::size_t i = 0; i < a.size() && recipe == kernels::fp8::Recipe::kDelayed; ++i)
          EXPECT_TRUE(a[i]->initialized() && at::equal(a[i]->amax_history, b[i]->amax_history));
      }
    }
  }
}

}  // namespace
}  // namespace parallax::models
