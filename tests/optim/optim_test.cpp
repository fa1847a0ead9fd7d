// optim: optimizers against LibTorch's reference implementations, master weights, parameter
// groups, LR schedules, global-norm clipping, the fp16 loss scaler and autocast.

#include "core/config.h"
#include "core/error.h"
#include "core/strings.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "optim/grad_utils.h"
#include "optim/optim_config.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "optim/precision.h"
#include "optim/schedule.h"
#include "tests/common/tolerance.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>

using namespace parallax;
namespace tol = parallax::testing;

namespace {

// Fresh random parameters and a sequence of random gradients.
struct Problem {
  std::vector<at::Tensor> init;
  std::vector<std::vector<at::Tensor>> grads;  // [step][param]
};

Problem make_problem(int steps, uint64_t seed) {
  at::manual_seed(seed);
  Problem p;
  for (auto shape : {std::vector<int64_t>{7, 5}, {5}, {3, 4, 2}})
    p.init.push_back(at::randn(shape));
  for (int s = 0; s < steps; ++s) {
    std::vector<at::Tensor> g;
    for (const auto& t : p.init) g.push_back(at::randn_like(t));
    p.grads.push_back(g);
  }
  return p;
}

std::vector<at::Tensor> clone_params(const Problem& p) {
  std::vector<at::Tensor> out;
  for (const auto& t : p.init) out.push_back(t.clone().set_requires_grad(true));
  return out;
}

optim::ParamGroup group_of(const std::vector<at::Tensor>& params, double wd) {
  optim::ParamGroup g;
  g.name = "all";
  g.weight_decay = wd;
  for (std::size_t i = 0; i < params.size(); ++i) {
    g.names.push_back("p" + std::to_string(i));
    g.params.push_back(params[i]);
  }
  return g;
}

// Optimizer steps are elementwise (no sums), and an update does not depend on the parameter except
// through weight decay, a contraction: so the fp32 rounding of one implementation accumulates
// additively over the steps and never grows. The bounds below hold for any implementation that
// evaluates the same formulas with at most the stated number of roundings per operation (fused,
// FMA-contracted or not); two implementations differ by at most twice one's bound.
//
// AdamW, per element, against exact arithmetic after the steps with rates `lr`: each step rounds
// the decay p (1 - lr wd) (the factor as a float, the product) and the subtraction of the update,
// 3 u |p|; the update lr m_hat / (sqrt(v_hat) + eps) carries the state's roundings (m, v: 3 per
// step each, relative to magnitudes bounded by C max|g|) and about 8 more: at most
// lr C (6 t + 8) u. C bounds |m_hat| / sqrt(v_hat) and |g_t| / sqrt(v_hat): v_hat >= c_min g_s^2
// for every s <= t, c_min the smallest bias-corrected weight of v, so C = 1 / sqrt(c_min).
// |p| itself stays within |p_0| + sum_t lr (C + wd (|p_0| + 1)).
at::Tensor adamw_rounding(const at::Tensor& p0, const std::vector<double>& lr, double beta2,
                          double wd) {
  const double u = tol::kFp32Unit;
  const int steps = static_cast<int>(lr.size());
  double c_min = 1;
  for (int t = 1; t <= steps; ++t)
    c_min = std::min(c_min, (1 - beta2) * std::pow(beta2, t - 1) / (1 - std::pow(beta2, t)));
  const double c = 1 / std::sqrt(c_min);
  double drift = 0, update = 0;
  for (int t = 1; t <= steps; ++t) {
    drift += lr[t - 1] * (c + wd);
    update += lr[t - 1] * c * (6 * t + 8) * u;
  }
  const at::Tensor p = p0.to(at::kDouble).abs() * (1 + drift) + drift;
  return 3 * u * steps * p + update;
}

// SGD with momentum mu (and Nesterov), per element, against exact arithmetic: run the method on
// magnitudes (|g|, |p|) beside an error bound. The buffer mu b + (g + wd p) takes 4 roundings of
// its magnitude per step and carries the parameter's error through wd; the direction (Nesterov:
// (g + wd p) + mu b, 4 more); the step p - lr d rounds 3 times (the rate as a float, the
// product, the difference).
at::Tensor sgd_rounding(const at::Tensor& p0, const std::vector<at::Tensor>& grads,
                        const std::vector<double>& lr, double mu, bool nesterov, double wd) {
  const double u = tol::kFp32Unit;
  at::Tensor pm = p0.to(at::kDouble).abs(), bm = at::zeros_like(pm), eb = at::zeros_like(pm),
             ep = at::zeros_like(pm);
  for (std::size_t t = 0; t < grads.size(); ++t) {
    const at::Tensor gm = grads[t].to(at::kDouble).abs() + wd * pm;
    bm = mu * bm + gm;
    eb = mu * eb + wd * ep + 4 * u * bm;
    const at::Tensor dm = nesterov ? gm + mu * bm : bm;
    const at::Tensor ed = nesterov ? mu * eb + wd * ep + 4 * u * dm : eb;
    pm = pm + lr[t] * dm;
    ep = ep + lr[t] * ed + 3 * u * (pm + lr[t] * dm);
  }
  return ep;
}

std::vector<at::Tensor> grads_of(const Problem& p, std::size_t param) {
  std::vector<at::Tensor> g;
  for (const auto& step : p.grads) g.push_back(step[param]);
  return g;
}

}  // namespace

TEST(OptimizerTest, AdamWMatchesLibTorchAdamWFusedAndReference) {
  const auto prob = make_problem(10, 11);
  for (bool fused : {true, false}) {
    auto ours = clone_params(prob);
    auto ref = clone_params(prob);
    optim::AdamW opt({group_of(ours, 0.05)}, 0.9, 0.95, 1e-8, fused);
    torch::optim::AdamW ref_opt(
        ref, torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.05));
    for (int s = 0; s < 10; ++s) {
      for (std::size_t i = 0; i < ours.size(); ++i) {
        ours[i].mutable_grad() = prob.grads[s][i].clone();
        ref[i].mutable_grad() = prob.grads[s][i].clone();
      }
      opt.step(3e-3);
      ref_opt.step();
    }
    for (std::size_t i = 0; i < ours.size(); ++i) {
      // Same algorithm, different kernels: twice one implementation's rounding (adamw_rounding).
      const at::Tensor bound =
          2 * adamw_rounding(prob.init[i], std::vector<double>(10, 3e-3), 0.95, 0.05);
      EXPECT_TRUE(tol::within(ours[i], ref[i], bound)) << "fused=" << fused << " param " << i;
      EXPECT_FALSE(at::equal(ours[i], prob.init[i]));
    }
    EXPECT_EQ(opt.steps(), 10);
  }
}

TEST(OptimizerTest, SgdMomentumMatchesLibTorchSgd) {
  const auto prob = make_problem(8, 12);
  for (bool nesterov : {false, true}) {
    for (bool fused : {true, false}) {
      auto ours = clone_params(prob);
      auto ref = clone_params(prob);
      optim::Sgd opt({group_of(ours, 1e-3)}, 0.9, nesterov, fused);
      torch::optim::SGD ref_opt(
          ref, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(nesterov).weight_decay(1e-3));
      for (int s = 0; s < 8; ++s) {
        for (std::size_t i = 0; i < ours.size(); ++i) {
          ours[i].mutable_grad() = prob.grads[s][i].clone();
          ref[i].mutable_grad() = prob.grads[s][i].clone();
        }
        opt.step(0.05);
        ref_opt.step();
      }
      for (std::size_t i = 0; i < ours.size(); ++i) {
        const at::Tensor bound =
            2 * sgd_rounding(prob.init[i], grads_of(prob, i), std::vector<double>(8, 0.05), 0.9,
                             nesterov, 1e-3);
        EXPECT_TRUE(tol::within(ours[i], ref[i], bound))
            << "nesterov=" << nesterov << " fused=" << fused;
      }
    }
  }
}

// Capturable mode (CUDA graphs) reads the learning rate from a tensor written by set_lr(); with a
// changing schedule it must give what the plain fused step gives with the same rates, and leave
// the step count to the caller. (Runs on the CPU fused kernels; the CUDA ones are exercised by
// the trainer's graph test, tests/train/test_cuda_graph.py.)
TEST(OptimizerTest, CapturableStepReadsTheLearningRateTensor) {
  const auto prob = make_problem(6, 21);
  const std::vector<double> rates = {1e-3, 3e-3, 2e-3, 5e-4, 4e-3, 1e-3};
  for (const std::string name : {"adamw", "sgd"}) {
    auto plain = clone_params(prob);
    auto capt = clone_params(prob);
    auto make = [&](std::vector<at::Tensor>& ps, bool fused) -> std::unique_ptr<optim::Optimizer> {
      if (name == "adamw")
        return std::make_unique<optim::AdamW>(std::vector{group_of(ps, 0.05)}, 0.9, 0.95, 1e-8,
                                              fused);
      return std::make_unique<optim::Sgd>(std::vector{group_of(ps, 1e-3)}, 0.9, false, fused);
    };
    auto a = make(plain, true);
    auto b = make(capt, true);
    b->set_capturable(at::Device(at::kCPU));
    for (int s = 0; s < 6; ++s) {
      for (std::size_t i = 0; i < plain.size(); ++i) {
        plain[i].mutable_grad() = prob.grads[s][i].clone();
        capt[i].mutable_grad() = prob.grads[s][i].clone();
      }
      a->step(rates[s]);
      b->set_lr(rates[s]);
      b->step(/*ignored*/ 1.0);
      b->count_step();
    }
    for (std::size_t i = 0; i < plain.size(); ++i) {
      // The tensor holds the rate in fp32, the plain kernel gets a double: the same formulas with
      // rates u apart, so within both evaluations' rounding bounds (the rate's own rounding is one
      // of the roundings they count).
      const at::Tensor bound =
          2 * (name == "adamw"
                   ? adamw_rounding(prob.init[i], rates, 0.95, 0.05)
                   : sgd_rounding(prob.init[i], grads_of(prob, i), rates, 0.9, false, 1e-3));
      EXPECT_TRUE(tol::within(capt[i], plain[i], bound)) << name << " param " << i;
    }
    EXPECT_EQ(b->steps(), 6) << name;
    // The reference (unfused) kernels take the rate as a host number: refused, naming the key.
    auto c = make(capt, false);
    try {
      c->set_capturable(at::Device(at::kCPU));
      ADD_FAILURE() << name << ": unfused capturable accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("optim.fused"), std::string::npos) << e.what();
    }
  }
}

TEST(OptimizerTest, ParametersWithoutGradientKeepTheirValueAndState) {
  const auto prob = make_problem(1, 13);
  auto ps = clone_params(prob);
  optim::AdamW opt({group_of(ps, 0.1)}, 0.9, 0.999, 1e-8, true);
  ps[0].mutable_grad() = prob.grads[0][0].clone();  // only the first has a gradient
  opt.step(1e-2);
  EXPECT_FALSE(at::equal(ps[0], prob.init[0]));
  EXPECT_TRUE(at::equal(ps[1], prob.init[1]));
  EXPECT_TRUE(at::equal(ps[2], prob.init[2]));
}

TEST(OptimizerTest, Bf16ParametersGetFp32MasterWeights) {
  at::manual_seed(3);
  at::Tensor p = at::randn({64}).to(at::kBFloat16).set_requires_grad(true);
  const at::Tensor start = p.detach().to(at::kFloat);
  optim::Sgd opt({group_of({p}, 0.0)}, 0.0, false, true);
  // 100 updates of 1e-4 each: every one is below bf16's resolution near |p| ~ 1, so a bf16-only
  // optimizer would never move; the fp32 master accumulates them.
  for (int s = 0; s < 100; ++s) {
    p.mutable_grad() = at::full({64}, -1.0, at::kBFloat16);
    opt.step(1e-4);
  }
  const auto state = opt.state();
  at::Tensor master;
  for (const auto& [k, v] : state) {
    if (k == "p0.master") master = v;
  }
  ASSERT_TRUE(master.defined());
  EXPECT_EQ(master.scalar_type(), at::kFloat);
  // Each step adds 1e-4 exactly in real arithmetic (the gradient is -1 exactly): the rate as a
  // float and the sum round, u (|p| + 1e-4), so 100 steps stay within 100 u (|start| + 0.0101).
  // A bf16-only update would be off by the whole 0.01.
  EXPECT_TRUE(tol::within(master, start.to(at::kDouble) + 0.01,
                          (start.to(at::kDouble).abs() + 0.0101) * tol::gamma_k(100)));
  EXPECT_TRUE(at::equal(p.detach(), master.to(at::kBFloat16)));
}

TEST(OptimizerTest, StateRoundTripsAndMismatchIsNamed) {
  const auto prob = make_problem(3, 14);
  auto a = clone_params(prob);
  optim::AdamW opt({group_of(a, 0.0)}, 0.9, 0.999, 1e-8, true);
  for (int s = 0; s < 3; ++s) {
    for (std::size_t i = 0; i < a.size(); ++i) a[i].mutable_grad() = prob.grads[s][i].clone();
    opt.step(1e-2);
  }
  std::map<std::string, at::Tensor> saved;
  for (const auto& [k, v] : opt.state()) saved[k] = v.clone();
  auto b = clone_params(prob);
  optim::AdamW opt2({group_of(b, 0.0)}, 0.9, 0.999, 1e-8, true);
  opt2.load_state(saved);
  EXPECT_EQ(opt2.steps(), 3);
  for (const auto& [k, v] : opt2.state()) EXPECT_TRUE(at::equal(v, saved.at(k))) << k;
  saved.erase("p1.exp_avg");
  try {
    opt2.load_state(saved);
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("'p1.exp_avg' is missing"), std::string::npos);
  }
}

TEST(ParamGroupsTest, NoDecayForBiasesNormsAndEmbeddings) {
  auto lin = torch::nn::Linear(4, 3);
  auto norm = torch::nn::LayerNorm(torch::nn::LayerNormOptions({3}));
  at::Tensor pos = at::zeros({1, 5, 3}).set_requires_grad(true);
  at::Tensor frozen = at::zeros({3, 3});  // requires_grad false
  optim::NamedParams named = {{"fc.weight", lin->weight},
                              {"fc.bias", lin->bias},
                              {"norm.weight", norm->weight},
                              {"pos_embed", pos},
                              {"frozen", frozen}};
  const auto groups = optim::make_param_groups(named, 0.05);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].names, (std::vector<std::string>{"fc.weight"}));
  EXPECT_EQ(groups[0].weight_decay, 0.05);  // copied, exact
  EXPECT_EQ(groups[1].names, (std::vector<std::string>{"fc.bias", "norm.weight", "pos_embed"}));
  EXPECT_EQ(groups[1].weight_decay, 0.0);
}

// The BEV model's learned queries (models/view_transformer.cpp registers "query_embed", a 4-D
// embedding) are an embedding like pos_embed: no weight decay (the list used to name "bev_queries",
// which matches no parameter of the zoo).
TEST(ParamGroupsTest, BevQueryEmbeddingGetsNoDecay) {
  auto model = models::build_model(
      [] {
        models::ModelConfig c;
        c.name = "bev";
        c.size = "tiny";
        return c;
      }(),
      models::benchmark_scene("tiny"));
  optim::NamedParams named;
  for (const auto& it : model->named_parameters()) named.emplace_back(it.key(), it.value());
  const auto groups = optim::make_param_groups(named, 0.05);
  bool found = false;
  for (const auto& g : groups) {
    for (const auto& n : g.names) {
      if (n.find("query_embed") == std::string::npos) continue;
      found = true;
      EXPECT_EQ(g.weight_decay, 0.0) << n << " is decayed";
    }
  }
  EXPECT_TRUE(found) << "the bev model has no query_embed parameter any more";
}

// ---- optim.param_groups and optim.layer_decay (optim/param_groups.h) ---------------------------

namespace {

optim::ParamGroupRule rule(const std::string& match, double lr_mult, double wd_mult = 1.0,
                           bool frozen = false) {
  optim::ParamGroupRule r;
  r.match = match;
  r.lr_mult = lr_mult;
  r.weight_decay_mult = wd_mult;
  r.frozen = frozen;
  return r;
}

// The optim section as the run config holds it (keys named from the root).
struct Root {
  optim::OptimConfig optim;
  template <class V>
  void visit(V& v) {
    v("optim", optim);
  }
  void validate() const { optim.validate(); }
};

// `fn` throws a ConfigError whose message names `needle`.
template <class Fn>
void expect_config_error(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no ConfigError (expected one naming '" << needle << "')";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// The bev tiny model's parameter names and shapes (ViT backbone "encoder.vit.*").
std::vector<optim::ParamShape> bev_tiny_shapes() {
  models::ModelConfig c;
  c.name = "bev";
  c.size = "tiny";
  auto model = models::build_model(c, models::benchmark_scene("tiny"));
  std::vector<optim::ParamShape> out;
  for (const auto& it : model->named_parameters())
    out.push_back({it.key(), it.value().dim(), it.value().numel(), false});
  return out;
}

}  // namespace

TEST(ParamGroupsTest, FirstMatchingRuleDecides) {
  optim::GroupSettings s = optim::group_settings(
      0.05, {rule("encoder.vit.block0.*", 0.5, 2.0), rule("encoder.*", 0.1, 0.0)}, 1.0, {});
  // block0 is matched by both rules: the first one in list order decides.
  const auto a = optim::assign_param("encoder.vit.block0.mlp.fc1.weight", 2, s);
  EXPECT_EQ(a.rule, 0);
  EXPECT_EQ(a.lr_mult, 0.5);
  EXPECT_EQ(a.weight_decay, 0.05 * 2.0);
  const auto b = optim::assign_param("encoder.vit.block1.mlp.fc1.weight", 2, s);
  EXPECT_EQ(b.rule, 1);
  EXPECT_EQ(b.lr_mult, 0.1);
  EXPECT_EQ(b.weight_decay, 0.0);  // weight_decay_mult 0
  // No rule: defaults; 1-D and embeddings never decay whatever the rule says.
  const auto c = optim::assign_param("heads.seg_out.weight", 4, s);
  EXPECT_EQ(c.rule, -1);
  EXPECT_EQ(c.lr_mult, 1.0);
  EXPECT_EQ(c.weight_decay, 0.05);
  EXPECT_EQ(optim::assign_param("encoder.vit.block0.norm1.weight", 1, s).weight_decay, 0.0);
  EXPECT_EQ(optim::assign_param("encoder.vit.pos_embed", 3, s).weight_decay, 0.0);
  // The reverse order: the broad rule takes block0 too, and the narrow one decides nothing, which
  // check_param_groups names as an error.
  std::swap(s.rules[0], s.rules[1]);
  EXPECT_EQ(optim::assign_param("encoder.vit.block0.mlp.fc1.weight", 2, s).rule, 0);
  expect_config_error([&] { optim::check_param_groups(bev_tiny_shapes(), s); },
                      "optim.param_groups[1].match");
}

TEST(ParamGroupsTest, RuleMatchingNoParameterIsAnError) {
  const auto shapes = bev_tiny_shapes();
  const optim::GroupSettings s =
      optim::group_settings(0.05, {rule("encoder.*", 0.1), rule("encodr.vit.*", 0.5)}, 1.0, {});
  try {
    optim::check_param_groups(shapes, s);
    FAIL() << "a rule that matches nothing was accepted";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("optim.param_groups[1].match"), std::string::npos) << what;
    EXPECT_NE(what.find("encodr.vit.*"), std::string::npos) << what;
    EXPECT_NE(what.find("matches no parameter"), std::string::npos) << what;
  }
}

TEST(ParamGroupsTest, FreezingEverythingIsAnError) {
  const auto shapes = bev_tiny_shapes();
  expect_config_error(
      [&] {
        optim::check_param_groups(shapes,
                                  optim::group_settings(0.05, {rule("*", 1, 1, true)}, 1.0, {}));
      },
      "optim.param_groups");
  // Freezing part of it is fine; the table counts the frozen rule's parameters.
  const auto rows = optim::check_param_groups(
      shapes, optim::group_settings(0.05, {rule("encoder.*", 1, 1, true)}, 1.0, {}));
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_TRUE(rows[0].frozen);
  EXPECT_GT(rows[0].params, 0);
  EXPECT_EQ(rows[1].label, "(default)");
}

TEST(ParamGroupsTest, ConfigReadsRulesAndRefusesUnknownKeysAndBadValues) {
  const auto load = [](const std::string& yaml) {
    Root r;
    std::string text = "optim:\n";
    for (const auto& line : core::split(yaml, '\n'))
      if (!line.empty()) text += "  " + line + "\n";
    core::bind(core::ConfigTree::from_string(text, "test.yaml"), r);
    return r.optim;
  };
  const auto c = load(
      "param_groups: [{match: 'encoder.*', lr_mult: 0.1}, {match: 'x', frozen: true}]\n"
      "layer_decay: 0.75\n");
  ASSERT_EQ(c.param_groups.size(), 2u);
  EXPECT_EQ(c.param_groups[0].match, "encoder.*");
  EXPECT_EQ(c.param_groups[0].lr_mult, 0.1);
  EXPECT_EQ(c.param_groups[0].weight_decay_mult, 1.0);  // the element's default
  EXPECT_TRUE(c.param_groups[1].frozen);
  EXPECT_EQ(c.layer_decay, 0.75);
  expect_config_error([&] { load("param_groups: [{match: 'a', lr_mul: 0.1}]\n"); },
                      "optim.param_groups[0].lr_mul");
  expect_config_error([&] { load("param_groups: [{match: 'a', lr_mult: -1}]\n"); },
                      "optim.param_groups[0].lr_mult");
  expect_config_error([&] { load("param_groups: [{match: 'a', weight_decay_mult: .inf}]\n"); },
                      "optim.param_groups[0].weight_decay_mult");
  expect_config_error([&] { load("layer_decay: 0\n"); }, "optim.layer_decay");
  expect_config_error([&] { load("layer_decay: 1.5\n"); }, "optim.layer_decay");
  // Written back as a list of sections, and read again to the same rules.
  Root w;
  w.optim = c;
  Root again_root;
  core::bind(core::ConfigTree::from_string(core::emit_yaml(core::to_yaml(w)), "again.yaml"),
             again_root);
  const optim::OptimConfig& again = again_root.optim;
  ASSERT_EQ(again.param_groups.size(), 2u);
  EXPECT_EQ(again.param_groups[0].lr_mult, 0.1);
  EXPECT_TRUE(again.param_groups[1].frozen);
}

// BEiT/MAE: lr scale = layer_decay^(depth + 1 - id), embedding id 0, block i id i + 1, after the
// last block depth + 1 (scale 1); the ids come from the model (Model::layer_depth).
TEST(ParamGroupsTest, LayerDecayScalesOfAVitNameSet) {
  const int depth = 2;
  const double d = 0.75;
  struct Case {
    const char* name;
    int id;
  } cases[] = {{"encoder.vit.patch_embed.weight", 0},
               {"encoder.vit.pos_embed", 0},
               {"encoder.vit.reg_token", 0},
               {"encoder.vit.cls_token", 0},
               {"encoder.vit.block0.attn.qkv.weight", 1},
               {"encoder.vit.block0.ls1.gamma", 1},
               {"encoder.vit.block1.mlp.fc2.bias", 2},
               {"encoder.vit.block1.ls2.gamma", 2},
               {"encoder.vit.norm.weight", 3},
               {"encoder.neck.weight", 3},
               {"heads.seg_out.weight", 3}};
  for (const auto& c : cases) {
    const models::LayerDepth ld = models::vit_layer_depth(c.name, "encoder.vit.", depth);
    EXPECT_EQ(ld.id, c.id) << c.name;
    EXPECT_EQ(ld.depth, depth) << c.name;
  }
  // vit_cls names "vit.*", and a block number of two digits.
  EXPECT_EQ(models::vit_layer_depth("vit.block11.attn.proj.weight", "vit.", 12).id, 12);
  EXPECT_EQ(models::vit_layer_depth("head.weight", "vit.", 12).id, 13);
  // Through the settings: the scale times the rule's lr_mult.
  const optim::LayerOf layers = [&](const std::string& n) -> std::optional<optim::LayerPosition> {
    const auto ld = models::vit_layer_depth(n, "encoder.vit.", depth);
    return optim::LayerPosition{ld.id, ld.depth};
  };
  const auto s = optim::group_settings(0.05, {rule("encoder.vit.block1.*", 0.5)}, d, layers);
  for (const auto& c : cases) {
    const auto a = optim::assign_param(c.name, 2, s);
    const double scale = std::pow(d, depth + 1 - c.id);
    EXPECT_EQ(a.layer, c.id) << c.name;
    EXPECT_DOUBLE_EQ(a.lr_mult, scale * (a.rule == 0 ? 0.5 : 1.0)) << c.name;
  }
  EXPECT_DOUBLE_EQ(optim::assign_param("encoder.vit.patch_embed.weight", 4, s).lr_mult, d * d * d);
  // The real bev tiny model reports the same ids; the conv backbone reports none.
  models::ModelConfig mc;
  mc.name = "bev";
  mc.size = "tiny";
  auto vit = models::build_model(mc, models::benchmark_scene("tiny"));
  EXPECT_EQ(vit->layer_depth("encoder.vit.block0.attn.qkv.weight")->id, 1);
  EXPECT_EQ(vit->layer_depth("encoder.vit.pos_embed")->id, 0);
  mc.backbone = "conv";
  auto conv = models::build_model(mc, models::benchmark_scene("tiny"));
  EXPECT_FALSE(conv->layer_depth(conv->named_parameters()[0].key()).has_value());
}

TEST(ParamGroupsTest, GroupsCarryLrMultAndTheDefaultGroupsStayTwo) {
  auto lin = torch::nn::Linear(4, 3);
  auto enc = torch::nn::Linear(3, 3);
  optim::NamedParams named = {{"encoder.fc.weight", enc->weight},
                              {"encoder.fc.bias", enc->bias},
                              {"head.weight", lin->weight},
                              {"head.bias", lin->bias}};
  const auto plain = optim::make_param_groups(named, optim::group_settings(0.05, {}, 1.0, {}));
  ASSERT_EQ(plain.size(), 2u);
  EXPECT_EQ(plain[0].name, "decay");
  EXPECT_EQ(plain[0].lr_mult, 1.0);
  const auto g = optim::make_param_groups(
      named, optim::group_settings(0.05, {rule("encoder.*", 0.1, 0.5)}, 1.0, {}));
  ASSERT_EQ(g.size(), 4u);
  EXPECT_EQ(g[0].names, (std::vector<std::string>{"encoder.fc.weight"}));
  EXPECT_EQ(g[0].lr_mult, 0.1);
  EXPECT_EQ(g[0].weight_decay, 0.05 * 0.5);
  EXPECT_EQ(g[1].names, (std::vector<std::string>{"encoder.fc.bias"}));
  EXPECT_EQ(g[1].lr_mult, 0.1);
  EXPECT_EQ(g[1].weight_decay, 0.0);
  EXPECT_EQ(g[2].lr_mult, 1.0);
  EXPECT_EQ(g[2].weight_decay, 0.05);
}

// Optimizer::step uses lr x the group's lr_mult, in both kernels of both optimizers: with plain
// SGD (momentum 0, no decay) a parameter moves by exactly lr * mult * grad.
TEST(ParamGroupsTest, StepUsesEachGroupsLrMult) {
  for (const bool fused : {true, false}) {
    at::manual_seed(5);
    at::Tensor a = at::randn({6, 5}).set_requires_grad(true);
    at::Tensor b = at::randn({7}).set_requires_grad(true);
    const at::Tensor a0 = a.detach().clone(), b0 = b.detach().clone();
    a.mutable_grad() = at::randn({6, 5});
    b.mutable_grad() = at::randn({7});
    optim::ParamGroup ga{"a", {"a"}, {a}, 0.0, 0.1};
    optim::ParamGroup gb{"b", {"b"}, {b}, 0.0, 1.0};
    optim::Sgd sgd({ga, gb}, 0.0, false, fused);
    const double lr = 0.3;
    sgd.step(lr);
    // at::_fused_sgd_ (momentum 0, weight decay 0) and the reference both compute
    // p + (-lr_f) * g in fp32 with lr_f the float of the double lr * mult: add_(g, -lr * mult)
    // rounds the same products and sums once each.
    EXPECT_TRUE(at::equal(a.detach(), a0.add(a.grad(), -(lr * 0.1)))) << "fused " << fused;
    EXPECT_TRUE(at::equal(b.detach(), b0.add(b.grad(), -lr))) << "fused " << fused;
    EXPECT_FALSE(at::equal(a.detach(), a0.add(a.grad(), -lr)));
  }
  // Capturable mode (CUDA graphs; here the CPU fused kernel): one lr tensor per distinct lr_mult,
  // written by set_lr as the fp32 of lr * mult, the same rate the plain step rounds to.
  at::manual_seed(6);
  at::Tensor a = at::randn({6, 5}).set_requires_grad(true);
  at::Tensor b = at::randn({7}).set_requires_grad(true);
  at::Tensor c = at::randn({3}).set_requires_grad(true);
  const at::Tensor a0 = a.detach().clone(), b0 = b.detach().clone(), c0 = c.detach().clone();
  for (at::Tensor* t : {&a, &b, &c}) t->mutable_grad() = at::randn_like(*t);
  optim::Sgd sgd(
      {optim::ParamGroup{"a", {"a"}, {a}, 0.0, 0.1}, optim::ParamGroup{"b", {"b"}, {b}, 0.0, 1.0},
       optim::ParamGroup{"c", {"c"}, {c}, 0.0, 0.1}},
      0.0, false, true);
  sgd.set_capturable(at::Device(at::kCPU));
  sgd.set_lr(0.3);
  sgd.step(/*ignored*/ 123.0);
  EXPECT_TRUE(at::equal(a.detach(), a0.add(a.grad(), -(0.3 * 0.1))));
  EXPECT_TRUE(at::equal(b.detach(), b0.add(b.grad(), -0.3)));
  EXPECT_TRUE(at::equal(c.detach(), c0.add(c.grad(), -(0.3 * 0.1))));
}

TEST(ScheduleTest, WarmupThenCosineLinearConstant) {
  optim::ScheduleConfig c;
  c.warmup_steps = 10;
  c.min_lr_ratio = 0.1;
  c.name = "cosine";
  // Warmup peak * step / warmup: 1 * 1 / 10 rounds to the literal 0.1, 10 / 10 is 1: exact.
  EXPECT_EQ(optim::lr_at(c, 1.0, 1, 110), 0.1);
  EXPECT_EQ(optim::lr_at(c, 1.0, 10, 110), 1.0);
  // Decay: at most 6 double roundings of values <= peak, and cos(pi t) within 2^-53 (libm) plus
  // |fl(pi) - pi| / 2 < 2^-53 of exact: within 16 u64 peak of the real value, whose literal is
  // within u64 of it.
  const double near = 16 * tol::kFp64Unit;
  EXPECT_NEAR(optim::lr_at(c, 1.0, 60, 110), 0.55, near);  // half way: mean of peak and floor
  EXPECT_NEAR(optim::lr_at(c, 1.0, 110, 110), 0.1, near);
  c.name = "linear";
  EXPECT_NEAR(optim::lr_at(c, 2.0, 60, 110), 1.1, 2 * near);
  EXPECT_NEAR(optim::lr_at(c, 2.0, 110, 110), 0.2, 2 * near);
  c.name = "constant";
  EXPECT_EQ(optim::lr_at(c, 2.0, 100, 110), 2.0);  // returned as given
  c.warmup_steps = 0;
  c.name = "cosine";
  EXPECT_NEAR(optim::lr_at(c, 1.0, 0, 100), 1.0, near);
}

TEST(ClipTest, GlobalNormMatchesLibTorchClip) {
  const auto prob = make_problem(1, 15);
  auto ours = clone_params(prob), ref = clone_params(prob);
  std::vector<at::Tensor> grads;
  for (std::size_t i = 0; i < ours.size(); ++i) {
    ours[i].mutable_grad() = prob.grads[0][i].clone() * 3.0;
    ref[i].mutable_grad() = prob.grads[0][i].clone() * 3.0;
    grads.push_back(ours[i].grad());
  }
  const double ref_norm = torch::nn::utils::clip_grad_norm_(ref, 1.5);
  const double norm = optim::clip_grad_norm(grads, 1.5).item<double>();
  // Both norms of the same P = 64 elements in T = 3 tensors, each within gamma(P + 2T + 4) of
  // exact (P squares summed per tensor in any order, T norms squared and summed, the roots).
  const double rel = 2 * tol::gamma_k(64 + 2 * 3 + 4);
  EXPECT_NEAR(norm, ref_norm, rel * ref_norm);
  // Each scales by 1.5 / (norm + 1e-6) (an add, a divide, a product: 3 more roundings each).
  for (std::size_t i = 0; i < ours.size(); ++i) {
    EXPECT_TRUE(
        tol::within(ours[i].grad(), ref[i].grad(), ref[i].grad().abs() * (rel + tol::gamma_k(6))));
  }
  // Below the threshold nothing changes.
  const at::Tensor before = ours[0].grad().clone();
  optim::clip_grad_norm(grads, 1e6);
  EXPECT_TRUE(at::equal(before, ours[0].grad()));
}

TEST(LossScalerTest, InfSkipsAndHalvesCleanStepsGrow) {
  optim::LossScaler s(true, 1024.0, /*growth_interval=*/3, /*min_scale=*/1.0);
  at::Tensor g = at::randn({10}) * 1024.0;
  const at::Tensor expect = g / 1024.0;
  EXPECT_FALSE(s.unscale_and_check({g}));
  EXPECT_TRUE(at::equal(g, expect));  // powers of two scale exactly
  s.update(false);
  at::Tensor bad = at::randn({10});
  bad[3] = INFINITY;
  EXPECT_TRUE(s.unscale_and_check({g.clone(), bad}));
  s.update(true);
  EXPECT_EQ(s.scale(), 512.0);  // halving and doubling are exact
  EXPECT_EQ(s.skipped_steps(), 1);
  at::Tensor nan = at::randn({4});
  nan[0] = NAN;
  EXPECT_TRUE(s.unscale_and_check({nan}));
  for (int i = 0; i < 3; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 1024.0);  // doubled after 3 clean steps
  EXPECT_EQ(s.scale_loss(at::ones({})).item<double>(), 1024.0);
}

TEST(LossScalerTest, CollapseIsAClearError) {
  optim::LossScaler s(true, 4.0, 100, 2.0);
  s.update(true);  // 4 -> 2
  try {
    s.update(true);  // would go to 1 < 2
    FAIL();
  } catch (const NumericsError& e) {
    EXPECT_NE(std::string(e.what()).find("loss scale collapsed"), std::string::npos);
  }
  optim::LossScaler off(false);
  at::Tensor bad = at::full({2}, INFINITY);
  EXPECT_FALSE(off.unscale_and_check({bad}));
  EXPECT_EQ(off.scale(), 1.0);
}

TEST(PrecisionTest, AutocastGuardCastsMatmulsAndRestores) {
  const at::Tensor a = at::randn({8, 8}), b = at::randn({8, 8});
  optim::PrecisionConfig cfg;
  cfg.mode = "bf16";
  const auto policy = optim::make_precision_policy(cfg, c10::kCPU);
  {
    optim::AutocastGuard guard(policy);
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16);
  }
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
  cfg.mode = "fp32";
  optim::AutocastGuard none(optim::make_precision_policy(cfg, c10::kCPU));
  EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
}

// The range checks of the config reader let `inf` through (inf > 0); a non-finite learning rate
// or decay turns the first step's weights into NaN, so validation refuses it naming the key.
TEST(OptimConfigTest, NonFiniteHyperParametersAreConfigErrorsNamingTheKey) {
  for (const char* key : {"lr", "weight_decay", "eps", "grad_clip"}) {
    for (const char* value : {"inf", ".inf", "+.inf"}) {
      optim::OptimConfig cfg;
      core::ConfigTree tree = core::ConfigTree::from_node(core::to_yaml(cfg), "default");
      tree.apply_override(fmt::format("{}={}", key, value));
      try {
        core::bind(tree, cfg);
        ADD_FAILURE() << key << "=" << value << " accepted";
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find(fmt::format("'optim.{}'", key)), std::string::npos)
            << e.what();
      }
    }
  }
  optim::OptimConfig finite;
  core::ConfigTree tree = core::ConfigTree::from_node(core::to_yaml(finite), "default");
  tree.apply_override("lr=1e30");  // finite, however absurd: a run's divergence, not a config error
  EXPECT_NO_THROW(core::bind(tree, finite));
}
