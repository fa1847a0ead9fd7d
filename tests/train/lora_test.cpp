// LoRA (train/lora/lora.h, models/layers.h DenseLinear::add_lora): the adapter's arithmetic, its
// merge, and the config errors. One process, CPU, fp32. The trainer-level behaviour (adapter-only
// checkpoints, base fingerprint, DDP and ZeRO-3, merged export) is tests/train/test_lora.py.
//
// Tolerance (tests/TOLERANCES.md): the merged layer computes x (W + s B A)^T + b, the adapted one
// (without dropout) the same effective weight in fp32; were it the two-GEMM form x W^T + b +
// s (x A^T) B^T, both would be sums of the same exact products in another grouping, each term
// rounded at most (in + r + 3) times, so they differ by at most
// 2 gamma(in + r + 3) (|x| |W|^T + s |x| |A|^T |B|^T + |b|) elementwise (the magnitudes computed
// in float64): the bound covers either form.
#include "train/lora/lora.h"
#include "core/error.h"
#include "core/glob.h"
#include "models/layers.h"
#include "models/model.h"
#include "tests/common/tolerance.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

using namespace parallax;
namespace tol = parallax::testing;

namespace {

std::shared_ptr<models::Model> vit_tiny() {
  models::ModelConfig mc;
  mc.name = "vit_cls";
  mc.size = "tiny";
  return models::build_model(mc, core::SceneSpec{});
}

}  // namespace

TEST(LoraTest, AnAdapterStartsAsTheIdentityAndMergesIntoTheWeight) {
  at::manual_seed(3);
  models::DenseLinear layer(40, 24, true);
  const at::Tensor x = at::randn({7, 5, 40});
  const at::Tensor before = layer->forward(x).detach().clone();
  layer->add_lora(4, 8.0, 0.0);
  EXPECT_TRUE(at::equal(layer->forward(x), before)) << "B = 0: the output must not change";
  EXPECT_EQ(layer->lora_scale(), 2.0);
  {
    at::NoGradGuard ng;
    layer->lora_b.normal_(0, 0.5);  // a trained adapter
  }
  const at::Tensor unmerged = layer->forward(x).detach().clone();
  EXPECT_FALSE(at::equal(unmerged, before));
  const at::Tensor a = layer->lora_a.detach().to(at::kDouble).abs(),
                   b = layer->lora_b.detach().to(at::kDouble).abs(),
                   w = layer->weight.detach().to(at::kDouble).abs(),
                   bias = layer->bias.detach().to(at::kDouble).abs(), ax = x.to(at::kDouble).abs();
  const at::Tensor mag =
      at::matmul(ax, w.t()) + 2.0 * at::matmul(at::matmul(ax, a.t()), b.t()) + bias;
  layer->merge_lora();
  EXPECT_FALSE(layer->has_lora());
  std::vector<std::string> names;
  for (const auto& it : layer->named_parameters()) names.push_back(it.key());
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias"}));
  const at::Tensor merged = layer->forward(x).detach();
  EXPECT_TRUE(tol::within(merged, unmerged, 2 * tol::gamma_k(40 + 4 + 3) * mag));
}

// With dropout on the adapter's input (training), the adapter runs as its own two GEMMs:
// exactly x W^T + b + s (dropout(x) A^T) B^T, the mask drawn as at::dropout draws it.
TEST(LoraTest, WithDropoutTheAdapterIsItsOwnPathOnTheDroppedInput) {
  at::manual_seed(9);
  models::DenseLinear layer(16, 12, true);
  layer->add_lora(3, 6.0, 0.25);
  {
    at::NoGradGuard ng;
    layer->lora_b.normal_();
  }
  layer->train();
  const at::Tensor x = at::randn({5, 16});
  at::manual_seed(11);
  const at::Tensor got = layer->forward(x).detach();
  at::manual_seed(11);
  const at::Tensor h = at::dropout(x, 0.25, true);
  const at::Tensor want = at::linear(x, layer->weight, layer->bias) +
                          at::linear(at::linear(h, layer->lora_a), layer->lora_b) * 2.0;
  EXPECT_TRUE(at::equal(got, want.detach()));
  layer->eval();  // no dropout: the effective-weight form
  EXPECT_FALSE(at::equal(layer->forward(x).detach(), got));
}

TEST(LoraTest, ApplyAdaptsTheTargetsAndFreezesTheRest) {
  at::manual_seed(5);
  auto model = vit_tiny();
  train::LoraConfig c;
  c.rank = 2;
  c.targets = {"*.attn.qkv", "*.mlp.fc1"};
  c.trainable = {"head.*"};
  const auto a = train::lora::apply(*model, c);
  EXPECT_GT(a.layers, 0);
  int64_t adapters = 0;
  for (const auto& it : model->named_parameters()) {
    const bool adapter = train::lora::is_adapter(it.key());
    const bool head = it.key().rfind("head.", 0) == 0;
    EXPECT_EQ(it.value().requires_grad(), adapter || head) << it.key();
    if (adapter) {
      adapters += it.value().numel();
      EXPECT_TRUE(it.key().find(".attn.qkv.lora_") != std::string::npos ||
                  it.key().find(".mlp.fc1.lora_") != std::string::npos)
          << it.key();
    }
  }
  EXPECT_EQ(adapters, a.adapter_params);
  // Every adapter lies in its layer's unit (units are module paths), as ZeRO-3 needs.
  std::set<std::string> in_units;
  for (const auto& u : model->units()) in_units.insert(u.param_names.begin(), u.param_names.end());
  for (const auto& it : model->named_parameters())
    EXPECT_EQ(in_units.count(it.key()), 1u) << it.key();
}

TEST(LoraTest, AGlobThatMatchesNothingIsAConfigErrorNamingTheKey) {
  auto model = vit_tiny();
  train::LoraConfig c;
  c.rank = 2;
  c.targets = {"*.attn.qkv", "*.nothing"};
  try {
    train::lora::apply(*model, c);
    ADD_FAILURE() << "accepted";
  } catch (const ConfigError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("lora.targets"), std::string::npos) << what;
    EXPECT_NE(what.find("'*.nothing'"), std::string::npos) << what;
    EXPECT_NE(what.find("qkv"), std::string::npos) << what;  // lists linear layers that exist
  }
  auto fresh = vit_tiny();
  c.targets = {"*.attn"};  // a module, but not a linear layer
  EXPECT_THROW(train::lora::apply(*fresh, c), ConfigError);
}

// Issue 35: lora.rank=100000 was accepted (and 10^9 allocates without bound). The update B A has
// rank at most min(in, out), so a rank above that of the smallest targeted layer is refused,
// naming the key, the rank and the layer, before any adapter exists; the bound itself is taken.
TEST(LoraTest, ARankAboveTheSmallestTargetedLayerIsRefusedNamingIt) {
  auto model = vit_tiny();
  train::LoraConfig c;
  c.targets = {"*.attn.qkv", "*.mlp.fc2"};
  std::string smallest;
  int64_t bound = -1;
  for (const auto& item : model->named_modules("", false)) {
    auto* d = dynamic_cast<models::DenseLinearImpl*>(item.value().get());
    if (d == nullptr ||
        !(core::glob_match(c.targets[0], item.key()) || core::glob_match(c.targets[1], item.key())))
      continue;
    const int64_t dim = std::min(d->weight.size(0), d->weight.size(1));
    if (bound < 0 || dim < bound) {
      bound = dim;
      smallest = item.key();
    }
  }
  ASSERT_GT(bound, 1);
  for (const int64_t rank : {bound + 1, int64_t{100000}}) {
    c.rank = rank;
    try {
      train::lora::apply(*model, c);
      ADD_FAILURE() << "rank " << rank << " accepted";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("key 'lora.rank': " + std::to_string(rank)), std::string::npos) << what;
      EXPECT_NE(what.find("'" + smallest + "'"), std::string::npos) << what;
      EXPECT_NE(what.find(std::to_string(bound)), std::string::npos) << what;
    }
    for (const auto& it : model->named_parameters())
      EXPECT_FALSE(train::lora::is_adapter(it.key())) << it.key();
  }
  c.rank = bound;
  EXPECT_GT(train::lora::apply(*model, c).layers, 0);
}

TEST(LoraTest, TheFingerprintSeesEveryBaseByteAndIgnoresAdapters) {
  at::manual_seed(7);
  models::DenseLinear layer(6, 4, true);
  const std::string f0 = train::lora::fingerprint(*layer);
  layer->add_lora(2, 4.0, 0.0);
  EXPECT_EQ(train::lora::fingerprint(*layer), f0);
  {
    at::NoGradGuard ng;
    layer->weight[1][2].add_(1e-6f);
  }
  EXPECT_NE(train::lora::fingerprint(*layer), f0);
}
