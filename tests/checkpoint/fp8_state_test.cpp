// The delayed FP8 recipe's scaling state in checkpoints (on the CPU, through ATen's CPU FP8 GEMM):
// vit_cls tiny with FP8 ViT blocks trains two steps, is saved, and a fresh FP8 model loaded from
// the checkpoint holds the same histories and computes the next step bitwise like the saved one.
// The histories are training-only: a model without FP8 (the exporter's) loads the checkpoint, and
// an FP8 model loads a checkpoint without them (starting from empty histories).
#include "checkpoint/checkpointer.h"
#include "checkpoint/weights.h"
#include "core/error.h"
#include "core/rng.h"
#include "kernels/fp8.h"
#include "models/model.h"
#include "models/model_config.h"
#include "models/vit.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>

using namespace parallax;
using namespace parallax::checkpoint;
namespace f8 = parallax::kernels::fp8;

namespace {

std::shared_ptr<models::Model> vit_tiny() {
  models::ModelConfig cfg;
  cfg.name = "vit_cls";
  cfg.size = "tiny";
  at::manual_seed(7);
  return models::build_model(cfg, core::SceneSpec{});
}

f8::Fp8Options delayed() {
  f8::Fp8Options o;
  o.recipe = f8::Recipe::kDelayed;
  o.amax_history = 4;
  return o;
}

// One training step's forward, backward and history roll; returns the loss.
at::Tensor train_step(models::Model& model, const core::TensorDict& batch) {
  const auto loss = model.loss(batch, model.forward(batch)).total;
  loss.backward();
  f8::roll_histories(f8::fp8_layers(model), {});
  for (auto& p : model.parameters()) p.mutable_grad().reset();
  return loss.detach();
}

void save(const std::string& dir, const torch::nn::Module& model, bool with_fp8_state) {
  SaveState s;
  for (const auto& it : model.named_parameters())
    s.add_replicated(kModelPrefix + it.key(), it.value());
  for (const auto& it : model.named_buffers()) {
    if (!with_fp8_state && is_fp8_state(it.key())) continue;
    s.add_replicated(kModelPrefix + it.key(), it.value());
  }
  Checkpointer ck(dir, CheckpointerOptions{}, CommitGroup{});
  ck.save(2, s);
}

}  // namespace

TEST(Fp8StateTest, DelayedHistoriesRoundTripAndResumeBitwise) {
  ckpt_test::ScratchDir tmp("fp8");
  auto model = vit_tiny();
  const int layers = models::enable_fp8(*model, delayed());
  ASSERT_GT(layers, 0);
  EXPECT_EQ(static_cast<std::size_t>(layers), f8::fp8_layers(*model).size());
  const core::TensorDict batch = model->example_batch(2);
  for (int i = 0; i < 2; ++i) train_step(*model, batch);
  for (auto* l : f8::fp8_layers(*model)) ASSERT_GT(l->amax_history.max().item<float>(), 0.f);
  const std::string dir = (tmp / "checkpoints").string();
  save(dir, *model, true);

  auto resumed = vit_tiny();
  models::enable_fp8(*resumed, delayed());
  const WeightsReport r = load_weights(*resumed, dir);
  EXPECT_TRUE(r.clean()) << r.summary();
  for (auto* l : f8::fp8_layers(*resumed)) l->history_loaded();
  const auto a = model->named_buffers(), b = resumed->named_buffers();
  int histories = 0;
  for (const auto& it : a) {
    if (!is_fp8_state(it.key())) continue;
    ++histories;
    EXPECT_TRUE(at::equal(it.value(), b[it.key()])) << it.key();
  }
  EXPECT_EQ(histories, layers);
  for (auto* l : f8::fp8_layers(*resumed)) EXPECT_TRUE(l->initialized());
  // The next step of both: the same loss and the same histories, bit for bit.
  EXPECT_TRUE(at::equal(train_step(*model, batch), train_step(*resumed, batch)));
  for (const auto& it : model->named_buffers()) {
    if (is_fp8_state(it.key())) {
      EXPECT_TRUE(at::equal(it.value(), resumed->named_buffers()[it.key()])) << it.key();
    }
  }

  // The exporter's model (no FP8) loads the checkpoint: the histories are not "unexpected".
  auto plain = vit_tiny();
  const WeightsReport rp = load_weights(*plain, dir);
  EXPECT_TRUE(rp.clean()) << rp.summary();

  // An FP8 model from a checkpoint without histories (a bf16 run switched to fp8): empty ones.
  ckpt_test::ScratchDir tmp2("fp8b");
  save((tmp2 / "checkpoints").string(), *plain, false);
  auto switched = vit_tiny();
  models::enable_fp8(*switched, delayed());
  const WeightsReport rs = load_weights(*switched, (tmp2 / "checkpoints").string());
  EXPECT_TRUE(rs.clean()) << rs.summary();
  for (auto* l : f8::fp8_layers(*switched)) {
    l->history_loaded();
    EXPECT_FALSE(l->initialized());
  }
}

TEST(Fp8StateTest, Fp8RefusesLayersItCannotTake) {
  auto model = vit_tiny();
  models::enable_fp8(*model, f8::Fp8Options{});
  // Twice on one layer is a programming error; LoRA on an FP8 layer is the user's.
  for (const auto& m : model->modules()) {
    if (auto* d = dynamic_cast<models::DenseLinearImpl*>(m.get())) {
      if (d->fp8.is_empty()) continue;
      EXPECT_THROW(d->enable_fp8(f8::Fp8Options{}), Error);
      EXPECT_THROW(d->add_lora(4, 8, 0), ConfigError);
      EXPECT_THROW(d->add_quantizers(), ConfigError);
      break;
    }
  }
  models::DenseLinear odd(40, 48);
  EXPECT_THROW(odd->enable_fp8(f8::Fp8Options{}), ConfigError);
}
