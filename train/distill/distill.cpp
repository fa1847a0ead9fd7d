#include "train/distill/distill.h"

#include "checkpoint/finite.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "core/log.h"
#include "models/perception_model.h"
#include "train/run_config.h"
#include "train/trainer_hooks.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/conv.h>

#include <filesystem>

namespace parallax::train::distill {

namespace {

namespace fs = std::filesystem;

// What a distillation run keeps between its hooks.
struct State {
  const RunConfig* cfg = nullptr;
  torch::nn::Conv2d projection{nullptr};  // student -> teacher BEV channels (null: same count)
};

models::ModelConfig teacher_config(const RunConfig& cfg) {
  models::ModelConfig t = cfg.model;
  if (!distill::config(cfg).teacher_size.empty()) t.size = distill::config(cfg).teacher_size;
  if (!distill::config(cfg).teacher_backbone.empty())
    t.backbone = distill::config(cfg).teacher_backbone;
  return t;
}

// A teacher's map [B, C, X, Y] on the student's BEV grid (`like`): bilinearly resampled
// (align_corners false, as the model resamples its segmentation logits) when the sizes' query grids
// differ (e.g. bev small's 0.5 m cells against tiny's 1 m), in fp32.
at::Tensor on_grid(const at::Tensor& teacher, const at::Tensor& like) {
  const at::Tensor t = teacher.to(at::kFloat);
  if (t.size(2) == like.size(2) && t.size(3) == like.size(3)) return t;
  return at::upsample_bilinear2d(t, {like.size(2), like.size(3)}, /*align_corners=*/false);
}

// Each channel of each sample of `x` [B, C, X, Y] (fp32) to zero mean and unit variance over
// its X x Y cells (the biased variance, plus kStdEps so that a constant channel maps to zeros).
at::Tensor standardise(const at::Tensor& x) {
  constexpr double kStdEps = 1e-5;
  const at::Tensor mean = x.mean({2, 3}, /*keepdim=*/true);
  const at::Tensor var = (x - mean).pow(2).mean({2, 3}, /*keepdim=*/true);
  return (x - mean) / (var + kStdEps).sqrt();
}

}  // namespace

std::shared_ptr<models::Model> build_teacher(const RunConfig& cfg, const core::SceneSpec& scene) {
  const std::string& path = distill::config(cfg).teacher;
  std::error_code ec;
  PARALLAX_CHECK(fs::exists(path, ec), ConfigError,
                 "key 'distill.teacher': '{}' does not exist (a run directory, a checkpoint or a "
                 "weights.h5)",
                 path);
  // The SDPA kernel order is process-wide and build_model() sets it from the model section: the
  // teacher runs with the student's choice, which is set again afterwards.
  models::ModelConfig tc = teacher_config(cfg);
  tc.attention = cfg.model.attention;
  std::shared_ptr<models::Model> teacher;
  try {
    teacher = models::build_model(tc, scene);
  } catch (const ConfigError& e) {
    throw_error<ConfigError>(
        "distill.teacher_size / distill.teacher_backbone: the teacher {}/{}: {}", tc.name, tc.size,
        e.what());
  }
  models::set_attention_backend(cfg.model.attention);
  checkpoint::WeightsOptions w;
  w.strict = true;
  const auto report = checkpoint::load_weights(*teacher, path, w);
  // A NaN in the teacher would only show as a NaN loss at step 1: named here, at load time.
  checkpoint::require_finite(*teacher, fmt::format("distill.teacher '{}'", path),
                             "distillation needs a finite teacher; point distill.teacher at an "
                             "earlier checkpoint");
  core::log::info("distill.teacher={} ({}/{}{}): {}", path, tc.name, tc.size,
                  tc.name == "bev" ? "/" + tc.backbone : "", report.summary());
  teacher->eval();
  for (auto& p : teacher->parameters()) p.set_requires_grad(false);
  return teacher;
}

std::map<std::string, at::Tensor> loss_terms(const DistillConfig& cfg, const core::TensorDict& pred,
                                             const core::TensorDict& teacher_pred,
                                             torch::nn::Module* projection) {
  std::map<std::string, at::Tensor> out;
  const double t = cfg.temperature;
  const bool bev = pred.count("bev_logits") > 0;
  const char* logits = bev ? "bev_logits" : "logits";
  const double kl_weight = bev ? cfg.seg_kl : cfg.logit_kl;
  if (kl_weight > 0 && pred.count(logits)) {
    // Over the class dimension (1) of every cell (or sample): T^2 KL(p_teacher || p_student), in
    // fp32 whatever the autocast dtype; the mean over cells and samples.
    const at::Tensor s = at::log_softmax(pred.at(logits).to(at::kFloat) / t, 1);
    const at::Tensor q =
        at::log_softmax(teacher_pred.at(logits).to(at::kFloat) / t, 1);  // same label grid
    const at::Tensor kl = (q.exp() * (q - s)).sum(1).mean();
    out[bev ? "seg_kl" : "logit_kl"] = kl * (t * t * kl_weight);
  }
  if (cfg.heatmap > 0 && pred.count("heatmap")) {
    const at::Tensor s = pred.at("heatmap").to(at::kFloat);
    out["heatmap"] =
        at::mse_loss(at::sigmoid(s), at::sigmoid(on_grid(teacher_pred.at("heatmap"), s))) *
        cfg.heatmap;
  }
  if (cfg.feature > 0 && pred.count("bev_features")) {
    at::Tensor f = pred.at("bev_features");
    if (projection != nullptr) {
      f = dynamic_cast<torch::nn::Conv2dImpl&>(*projection)
              .forward(
                  f.to(dynamic_cast<torch::nn::Conv2dImpl&>(*projection).weight.scalar_type()));
    }
    at::Tensor g = on_grid(teacher_pred.at("bev_features"), f);
    PARALLAX_CHECK(f.sizes() == g.sizes(), ConfigError,
                   "distill.feature: the student's BEV features {} do not match the teacher's {}",
                   f.sizes(), g.sizes());
    f = f.to(at::kFloat);
    if (cfg.feature_norm == "channel") {
      f = standardise(f);
      g = standardise(g);
    }
    out["feature"] = at::mse_loss(f, g) * cfg.feature;
  }
  return out;
}

TrainerHooks hooks(const RunConfig& cfg) {
  const DistillConfig& d = distill::config(cfg);
  PARALLAX_CHECK(cfg.model.name == "bev" || cfg.model.name == "vit_cls", ConfigError,
                 "key 'distill.teacher': model '{}' has no logits, heatmap or BEV features to "
                 "distill (bev and vit_cls do)",
                 cfg.model.name);
  if (cfg.model.name == "bev") {
    PARALLAX_CHECK(d.seg_kl + d.heatmap + d.feature > 0, ConfigError,
                   "keys 'distill.seg_kl', 'distill.heatmap', 'distill.feature': every weight is "
                   "0, so the teacher would not be used");
  } else {
    PARALLAX_CHECK(d.logit_kl > 0, ConfigError,
                   "key 'distill.logit_kl': every weight is 0, so the teacher would not be used "
                   "(vit_cls distils its class logits only)");
  }
  auto state = std::make_shared<State>();
  state->cfg = &cfg;
  TrainerHooks h;
  h.task_loss_weight = d.student_loss;
  h.frozen_model = [state](const RunConfig& c, const core::SceneSpec& scene, c10::Device) {
    auto teacher = build_teacher(c, scene);
    if (auto* p = dynamic_cast<models::PerceptionModel*>(teacher.get()))
      p->set_feature_output(true);
    return teacher;
  };
  // The student returns its BEV features; a projection to the teacher's channel count when they
  // differ (a training-only module: models/model.h, kAuxModule).
  h.transform_model = [state](models::Model& m) {
    const RunConfig& c = *state->cfg;
    auto* student = dynamic_cast<models::PerceptionModel*>(&m);
    if (student == nullptr || distill::config(c).feature == 0) return;
    student->set_feature_output(true);
    models::ModelConfig tc = teacher_config(c);
    const int64_t sc = student->spec().bev_channels;
    const int64_t tch = models::make_bev_spec(tc, student->spec().scene).bev_channels;
    if (sc == tch && distill::config(c).adapter != "always") return;
    auto aux = std::make_shared<torch::nn::Module>();
    state->projection = aux->register_module(
        "distill_proj", torch::nn::Conv2d(torch::nn::Conv2dOptions(sc, tch, 1)));
    m.register_module(models::kAuxModule, aux);
    core::log::info(
        "distill: feature projection {} -> {} channels (aux.distill_proj, not exported)", sc, tch);
  };
  h.extra_loss = [state](const core::TensorDict& batch, const core::TensorDict& pred,
                         models::Model* teacher) {
    PARALLAX_CHECK(teacher != nullptr, Error, "distillation: no teacher");
    core::TensorDict tp;
    {
      at::NoGradGuard no_grad;
      tp = teacher->forward(batch);
    }
    return loss_terms(distill::config(*state->cfg), pred, tp,
                      state->projection ? state->projection.ptr().get() : nullptr);
  };
  return h;
}

}  // namespace parallax::train::distill
