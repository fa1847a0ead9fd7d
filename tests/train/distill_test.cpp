// Distillation (train/distill/distill.h): the KL term against a float64 hand computation, gradients
// that reach only the student (and the feature projection), a teacher that stays bit-unchanged, a
// teacher grid resampled to the student's, and the attention-kernel order the teacher leaves as
// the student set it.
#include "train/distill/distill.h"

#include "checkpoint/checkpointer.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "models/perception_model.h"
#include "train/run_config.h"
#include "train/trainer.h"

#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/conv.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <cmath>
#include <filesystem>

using namespace parallax;
namespace fs = std::filesystem;

namespace {

models::ModelConfig bev(const std::string& size) {
  models::ModelConfig m;
  m.name = "bev";
  m.size = size;
  return m;
}

// A checkpoint directory holding `model`'s tensors (what a teacher run leaves).
std::string save_model(const fs::path& dir, torch::nn::Module& model) {
  checkpoint::SaveState s;
  for (const auto& it : model.named_parameters())
    s.add_replicated("model/" + it.key(), it.value().detach());
  for (const auto& it : model.named_buffers())
    s.add_replicated("model/" + it.key(), it.value().detach());
  checkpoint::CheckpointerOptions o;
  o.timeout_s = 60;
  checkpoint::Checkpointer ck(
      dir.string(), o, checkpoint::CommitGroup{0, 1, c10::make_intrusive<c10d::HashStore>()});
  ck.save(1, s);
  return dir.string();
}

struct Scratch {
  fs::path path = fs::temp_directory_path() / ("distill_test_" + std::to_string(::getpid()));
  Scratch() { fs::create_directories(path); }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

}  // namespace

TEST(DistillTest, KlTermEqualsTheFloat64Computation) {
  at::manual_seed(1);
  const at::Tensor s = at::randn({2, 3, 2, 2}) * 3, t = at::randn({2, 3, 2, 2}) * 3;
  train::DistillConfig cfg;
  cfg.temperature = 2.0;
  cfg.seg_kl = 0.5;
  const auto terms =
      train::distill::loss_terms(cfg, {{"bev_logits", s}}, {{"bev_logits", t}}, nullptr);
  ASSERT_TRUE(terms.count("seg_kl"));
  // Hand computation in float64: per cell, sum_c q_c (log q_c - log p_c), q = softmax(t / T).
  double total = 0;
  const auto sd = s.to(at::kDouble), td = t.to(at::kDouble);
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t x = 0; x < 2; ++x) {
      for (int64_t y = 0; y < 2; ++y) {
        double zs = 0, zt = 0;
        for (int64_t c = 0; c < 3; ++c) {
          zs += std::exp(sd[b][c][x][y].item<double>() / 2);
          zt += std::exp(td[b][c][x][y].item<double>() / 2);
        }
        for (int64_t c = 0; c < 3; ++c) {
          const double q = std::exp(td[b][c][x][y].item<double>() / 2) / zt;
          const double p = std::exp(sd[b][c][x][y].item<double>() / 2) / zs;
          total += q * (std::log(q) - std::log(p));
        }
      }
    }
  }
  const double want = total / 8 * 4 * 0.5;  // the mean over 8 cells, T^2 = 4, weight 0.5
  // fp32: log_softmax and the products and sums of 3 classes over 8 cells: a few units of fp32
  // rounding (2^-24) relative to the terms' magnitudes (|q log q| <= 1, logits / T <= ~6): 1e-5.
  EXPECT_NEAR(terms.at("seg_kl").item<double>(), want, 1e-5 * (1 + std::abs(want)));
  // vit_cls: class logits [samples, classes], weighted by logit_kl (seg_kl does not apply). The
  // 8 cells as 8 samples: the same mean.
  cfg.logit_kl = 0.5;
  cfg.seg_kl = 0;
  auto rows = [](const at::Tensor& x) { return x.permute({0, 2, 3, 1}).reshape({8, 3}); };
  const auto cls =
      train::distill::loss_terms(cfg, {{"logits", rows(s)}}, {{"logits", rows(t)}}, nullptr);
  ASSERT_EQ(cls.size(), 1u);
  EXPECT_NEAR(cls.at("logit_kl").item<double>(), want, 1e-5 * (1 + std::abs(want)));
}

// The feature term against a float64 hand computation: the student's map through the 1x1 adapter
// (4 -> 6 channels), both maps standardised per sample and channel over their cells
// (feature_norm=channel, the default) or raw (none), then the mean squared difference, weighted.
TEST(DistillTest, FeatureTermWithTheAdapterEqualsTheFloat64Computation) {
  at::manual_seed(3);
  const int64_t B = 2, Cs = 4, Ct = 6, X = 3, Y = 5;
  const at::Tensor f = at::randn({B, Cs, X, Y}) * 4 + 1, g = at::randn({B, Ct, X, Y}) * 0.1 - 2;
  torch::nn::Conv2d proj(torch::nn::Conv2dOptions(Cs, Ct, 1));
  for (const char* norm : {"channel", "none"}) {
    SCOPED_TRACE(norm);
    train::DistillConfig cfg;
    cfg.seg_kl = cfg.heatmap = 0;
    cfg.feature = 0.7;
    cfg.feature_norm = norm;
    const auto terms = train::distill::loss_terms(cfg, {{"bev_features", f}}, {{"bev_features", g}},
                                                  proj.ptr().get());
    ASSERT_EQ(terms.size(), 1u);
    // float64: p[b][o][x][y] = bias[o] + sum_c W[o][c] f[b][c][x][y].
    const at::Tensor fd = f.to(at::kDouble), gd = g.to(at::kDouble);
    const at::Tensor w = proj->weight.detach().to(at::kDouble).view({Ct, Cs});
    const at::Tensor bias = proj->bias.detach().to(at::kDouble);
    std::vector<double> p(B * Ct * X * Y), t(B * Ct * X * Y);
    auto at4 = [&](int64_t b, int64_t c, int64_t x, int64_t y) {
      return ((b * Ct + c) * X + x) * Y + y;
    };
    for (int64_t b = 0; b < B; ++b)
      for (int64_t o = 0; o < Ct; ++o)
        for (int64_t x = 0; x < X; ++x)
          for (int64_t y = 0; y < Y; ++y) {
            double v = bias[o].item<double>();
            for (int64_t c = 0; c < Cs; ++c)
              v += w[o][c].item<double>() * fd[b][c][x][y].item<double>();
            p[at4(b, o, x, y)] = v;
            t[at4(b, o, x, y)] = gd[b][o][x][y].item<double>();
          }
    if (std::string(norm) == "channel") {
      for (auto* m : {&p, &t}) {
        for (int64_t b = 0; b < B; ++b)
          for (int64_t o = 0; o < Ct; ++o) {
            double mean = 0, var = 0;
            for (int64_t i = 0; i < X * Y; ++i) mean += (*m)[at4(b, o, 0, 0) + i];
            mean /= X * Y;
            for (int64_t i = 0; i < X * Y; ++i)
              var += std::pow((*m)[at4(b, o, 0, 0) + i] - mean, 2);
            var /= X * Y;  // biased, as the code's
            for (int64_t i = 0; i < X * Y; ++i)
              (*m)[at4(b, o, 0, 0) + i] =
                  ((*m)[at4(b, o, 0, 0) + i] - mean) / std::sqrt(var + 1e-5);
          }
      }
    }
    double want = 0;
    for (std::size_t i = 0; i < p.size(); ++i) want += (p[i] - t[i]) * (p[i] - t[i]);
    want = want / static_cast<double>(p.size()) * 0.7;
    // fp32: the mean of 180 non-negative squares in any order is within gamma_180 = 1.1e-5 of it
    // (relative); each square's operands carry the 1x1 conv's 5-term sums (bias + 4 products) or
    // the standardisation's 15-cell means and variance, a few tens of u relative to the map's
    // scale, at most doubled in the square: 3e-5 relative covers both.
    EXPECT_NEAR(terms.at("feature").item<double>(), want, 3e-5 * std::abs(want)) << want;
    if (std::string(norm) == "channel") EXPECT_LT(want, 4 * 0.7);  // 2 (1 - r) <= 4 per channel
  }
}

TEST(DistillTest, GradientsReachOnlyTheStudentAndTheTeacherIsUnchanged) {
  // A tiny student and a small teacher built for the tiny scene: other BEV channels (64 -> 128,
  // so the projection trains) and another query grid (resampled to the student's).
  const core::SceneSpec scene = models::benchmark_scene("tiny");
  at::manual_seed(2);
  auto student =
      std::dynamic_pointer_cast<models::PerceptionModel>(models::build_model(bev("tiny"), scene));
  auto teacher =
      std::dynamic_pointer_cast<models::PerceptionModel>(models::build_model(bev("small"), scene));
  ASSERT_TRUE(student && teacher);
  student->set_feature_output(true);
  teacher->set_feature_output(true);
  teacher->eval();
  for (auto& p : teacher->parameters()) p.set_requires_grad(false);
  std::map<std::string, at::Tensor> before;
  for (const auto& it : teacher->named_parameters()) before[it.key()] = it.value().clone();
  for (const auto& it : teacher->named_buffers()) before["buffer " + it.key()] = it.value().clone();
  torch::nn::Conv2d proj(torch::nn::Conv2dOptions(64, 128, 1));

  const core::TensorDict batch = student->example_batch(2);
  const core::TensorDict pred = student->forward(batch);
  core::TensorDict tp;
  {
    at::NoGradGuard no_grad;
    tp = teacher->forward(batch);
  }
  EXPECT_NE(tp.at("heatmap").size(2), pred.at("heatmap").size(2)) << "the grids should differ here";
  train::DistillConfig cfg;
  cfg.seg_kl = 1;  // every bev term (the KL over cells is off by default)
  const auto terms = train::distill::loss_terms(cfg, pred, tp, proj.ptr().get());
  ASSERT_EQ(terms.size(), 3u);
  at::Tensor total = at::zeros({});
  for (const auto& [k, v] : terms) {
    EXPECT_TRUE(std::isfinite(v.item<double>())) << k;
    EXPECT_GT(v.item<double>(), 0) << k;
    total = total + v;
  }
  total.backward();
  for (const auto& it : teacher->named_parameters()) {
    EXPECT_FALSE(it.value().grad().defined()) << it.key();
    EXPECT_TRUE(at::equal(it.value(), before.at(it.key()))) << it.key();
  }
  for (const auto& it : teacher->named_buffers())
    EXPECT_TRUE(at::equal(it.value(), before.at("buffer " + it.key()))) << it.key();
  EXPECT_TRUE(proj->weight.grad().defined());
  EXPECT_GT(proj->weight.grad().abs().sum().item<double>(), 0);
  int with_grad = 0;
  for (const auto& it : student->named_parameters())
    with_grad += it.value().grad().defined() ? 1 : 0;
  EXPECT_GT(with_grad, 10);  // the distillation terms reach the student's layers
}

TEST(DistillTest, TheTeacherLoadsStrictlyAndKeepsTheStudentsAttentionKernel) {
  Scratch tmp;
  const core::SceneSpec scene = models::benchmark_scene("tiny");
  models::ModelConfig tc = bev("tiny");
  tc.backbone = "vit";
  auto saved = models::build_model(tc, scene);
  const std::string dir = save_model(tmp.path / "teacher", *saved);

  train::RunConfig cfg;
  cfg.model = bev("tiny");
  cfg.model.attention = "math";
  train::distill::config(cfg).teacher = dir;
  train::distill::config(cfg).teacher_backbone = "vit";
  auto teacher = train::distill::build_teacher(cfg, scene);
  EXPECT_EQ(at::globalContext().sDPPriorityOrder()[0], at::SDPBackend::math);
  const auto want = saved->named_parameters();
  for (const auto& it : teacher->named_parameters()) {
    EXPECT_TRUE(at::equal(it.value(), want[it.key()])) << it.key();
    EXPECT_FALSE(it.value().requires_grad()) << it.key();
  }
  EXPECT_FALSE(teacher->is_training());
  models::set_attention_backend("auto");

  // Weights of another model: strict loading names the tensors.
  train::distill::config(cfg).teacher_backbone = "conv";
  try {
    train::distill::build_teacher(cfg, scene);
    ADD_FAILURE() << "a ViT checkpoint loaded into a conv teacher";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("encoder."), std::string::npos) << e.what();
  }
  train::distill::config(cfg).teacher = (tmp.path / "nowhere").string();
  try {
    train::distill::build_teacher(cfg, scene);
    ADD_FAILURE() << "a missing teacher accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("distill.teacher"), std::string::npos) << e.what();
  }
}

TEST(DistillTest, AuxModulesJoinTheLastUnitAndAreNeitherExportedNorExpected) {
  // The feature projection as the distillation transform adds it (models/model.h, kAuxModule).
  Scratch tmp;
  const core::SceneSpec scene = models::benchmark_scene("tiny");
  auto student = models::build_model(bev("tiny"), scene);
  auto aux = std::make_shared<torch::nn::Module>();
  aux->register_module("distill_proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(64, 128, 1)));
  student->register_module(models::kAuxModule, aux);
  const auto units = student->units();
  const auto& last = units.back().param_names;
  EXPECT_NE(std::find(last.begin(), last.end(), "aux.distill_proj.weight"), last.end());
  const std::string dir = save_model(tmp.path / "student", *student);
  const std::string out = (tmp.path / "weights.h5").string();
  checkpoint::export_weights(dir, out, at::kFloat);
  auto plain = models::build_model(bev("tiny"), scene);
  checkpoint::WeightsOptions strict;
  strict.strict = true;
  const auto from_ckpt = checkpoint::load_weights(*plain, dir, strict);
  EXPECT_TRUE(from_ckpt.clean()) << from_ckpt.summary();
  const auto from_h5 = checkpoint::load_weights(*plain, out, strict);
  EXPECT_TRUE(from_h5.clean()) << from_h5.summary();
  EXPECT_EQ(from_h5.loaded.size(), from_ckpt.loaded.size());
}
