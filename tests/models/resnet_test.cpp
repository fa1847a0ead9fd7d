// The ResNet backbones of the bev model (models/resnet.h): torchvision's names, shapes and counts;
// frozen batch norm (trainable affine, statistics that never change); a bottleneck against a
// reference written with ATen's conv2d and batch_norm; analytic costs against construction and the
// profiler; the encoder's units and activation model; the config errors (image size, tensor
// parallelism).
#include "models/resnet.h"
#include "core/error.h"
#include "models/backbone.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "tests/models/flop_profiler.h"
#include "units/param_init.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <map>
#include <string>
#include <vector>

namespace parallax::models {
namespace {

// torchvision.models.resnet50().state_dict() without fc.*, in its order: per module, its
// parameters then its buffers.
std::vector<std::string> torchvision_keys(const std::vector<int64_t>& layers) {
  std::vector<std::string> keys;
  const auto bn = [&](const std::string& p) {
    for (const char* leaf :
         {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"})
      keys.push_back(p + "." + leaf);
  };
  keys.push_back("conv1.weight");
  bn("bn1");
  for (std::size_t s = 0; s < layers.size(); ++s) {
    for (int64_t b = 0; b < layers[s]; ++b) {
      const std::string p = "layer" + std::to_string(s + 1) + "." + std::to_string(b) + ".";
      for (int k = 1; k <= 3; ++k) {
        keys.push_back(p + "conv" + std::to_string(k) + ".weight");
        bn(p + "bn" + std::to_string(k));
      }
      if (b == 0) {
        keys.push_back(p + "downsample.0.weight");
        bn(p + "downsample.1");
      }
    }
  }
  return keys;
}

// The module's state_dict keys in torchvision's order (each module's own parameters, then its own
// buffers, modules in registration order) and shapes.
std::vector<std::pair<std::string, std::vector<int64_t>>> state_dict(torch::nn::Module& m) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& item : m.named_modules()) {
    const std::string prefix = item.key().empty() ? "" : item.key() + ".";
    for (const auto& p : item.value()->named_parameters(false))
      out.emplace_back(prefix + p.key(), p.value().sizes().vec());
    for (const auto& b : item.value()->named_buffers(false))
      out.emplace_back(prefix + b.key(), b.value().sizes().vec());
  }
  return out;
}

ModelConfig bev_config(const std::string& backbone) {
  ModelConfig cfg;
  cfg.name = "bev";
  cfg.size = "tiny";
  cfg.backbone = backbone;
  return cfg;
}

core::SceneSpec small_scene() {
  core::SceneSpec s;
  s.num_cameras = 2;
  s.image_height = 64;
  s.image_width = 128;
  return s;
}

TEST(ResNetTest, TorchvisionStateDictNamesShapesAndCounts) {
  for (const int64_t depth : {50, 101}) {
    SCOPED_TRACE(depth);
    units::ShapeOnlyScope shape_only;  // names and shapes only: nothing is drawn
    ResNet net(depth, 64, 64);
    const auto sd = state_dict(*net);
    const std::vector<std::string> expected = torchvision_keys(resnet_layers(depth));
    // 53 convs and 53 batch norms (resnet50): 53 + 53 * 5 = 318 keys, as torchvision's 320 less
    // fc.weight and fc.bias; resnet101: 104 + 104 * 5 = 624.
    EXPECT_EQ(expected.size(), depth == 50 ? 318u : 624u);
    ASSERT_EQ(sd.size(), expected.size());
    for (std::size_t i = 0; i < sd.size(); ++i) EXPECT_EQ(sd[i].first, expected[i]) << i;
    // torchvision's parameter counts without fc (2048 * 1000 + 1000): resnet50 25,557,032 and
    // resnet101 44,549,160 in all.
    EXPECT_EQ(count_parameters(*net), depth == 50 ? 23'508'032 : 42'500'160);
    EXPECT_EQ(ResNetImpl::analytic_cost(depth, 64, 64).params, count_parameters(*net));
    std::map<std::string, std::vector<int64_t>> shape(sd.begin(), sd.end());
    using V = std::vector<int64_t>;
    EXPECT_EQ(shape.at("conv1.weight"), (V{64, 3, 7, 7}));
    EXPECT_EQ(shape.at("layer1.0.downsample.0.weight"), (V{256, 64, 1, 1}));
    EXPECT_EQ(shape.at("layer2.0.conv2.weight"), (V{128, 128, 3, 3}));
    EXPECT_EQ(shape.at("layer4.2.conv3.weight"), (V{2048, 512, 1, 1}));
    EXPECT_EQ(shape.at("layer4.2.bn3.num_batches_tracked"), V{});
  }
  // v1.5: the stride sits on conv2 (3x3), not conv1, and on the downsample's 1x1.
  ResNet net(50, 64, 64);
  const auto mods = net->named_modules();
  const auto stride = [&](const std::string& path) {
    return (*std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(mods[path])->options.stride())[0];
  };
  EXPECT_EQ(stride("layer2.0.conv1"), 1);
  EXPECT_EQ(stride("layer2.0.conv2"), 2);
  EXPECT_EQ(stride("layer2.0.downsample.0"), 2);
  EXPECT_EQ(stride("layer1.0.conv2"), 1);
  EXPECT_EQ(stride("layer1.0.downsample.0"), 1);
  // torchvision's init: BN weight 1, bias 0, mean 0, var 1; convs kaiming-normal fan_out.
  const auto named = net->named_parameters();
  const auto buffers = net->named_buffers();
  EXPECT_TRUE(at::equal(named["layer3.1.bn2.weight"], at::ones({256})));
  EXPECT_TRUE(at::equal(named["layer3.1.bn2.bias"], at::zeros({256})));
  EXPECT_TRUE(at::equal(buffers["layer3.1.bn2.running_var"], at::ones({256})));
  EXPECT_EQ(buffers["bn1.num_batches_tracked"].scalar_type(), at::kLong);
  // std = sqrt(2 / (out * k * k)); 1024 * 256 draws: the sample std within 1%.
  const at::Tensor w = named["layer3.0.conv3.weight"];  // [1024, 256, 1, 1]
  EXPECT_NEAR(w.std().item<double>() / std::sqrt(2.0 / 1024), 1.0, 0.01);
}

TEST(ResNetTest, EncoderRegistersTheTrunkUnderEncoderResnetWithoutFc) {
  at::manual_seed(3);
  auto model = build_model(bev_config("resnet50"), small_scene());
  int trunk = 0, fpn = 0;
  for (const auto& [name, shape] : state_dict(*model)) {
    EXPECT_EQ(name.find(".fc."), std::string::npos) << name;
    if (name.rfind("encoder.resnet.", 0) == 0) ++trunk;
    if (name.rfind("encoder.fpn.", 0) == 0) ++fpn;
  }
  EXPECT_EQ(trunk, 318);
  EXPECT_EQ(fpn, 6);  // lateral_convs.{0,1} and fpn_convs.0, weight and bias
  auto* bev = dynamic_cast<PerceptionModel*>(model.get());
  ASSERT_NE(bev, nullptr);
  EXPECT_EQ(bev->encoder()->stride(), 16);
  EXPECT_EQ(bev->encoder()->blocks().size(), 16u);
  std::vector<std::string> names;
  for (const Unit& u : model->units()) names.push_back(u.name);
  EXPECT_EQ(names, (std::vector<std::string>{"encoder.resnet.layer1", "encoder.resnet.layer2",
                                             "encoder.resnet.layer3", "encoder.fpn", "view",
                                             "bev_block0", "bev_block1", "heads"}));
  // The feature map: [B*N, C, H/16, W/16].
  at::Tensor images = at::randn({2, 3, 64, 128});
  EXPECT_EQ(bev->encoder()->forward(images).sizes(), (at::IntArrayRef{2, 64, 4, 8}));
}

TEST(ResNetTest, FrozenBatchNormTrainsItsAffineButNeverItsStatistics) {
  at::manual_seed(5);
  Bottleneck block(32, 8, 2, 8, 8);  // with a downsample
  {
    at::NoGradGuard no_grad;
    for (auto& b : block.named_buffers()) {
      if (b.key().find("running_mean") != std::string::npos) b.value().normal_();
      if (b.key().find("running_var") != std::string::npos) b.value().uniform_(0.5, 2.0);
    }
  }
  std::map<std::string, at::Tensor> before;
  for (const auto& p : block.named_parameters()) before[p.key()] = p.value().detach().clone();
  for (const auto& b : block.named_buffers()) before[b.key()] = b.value().clone();
  block.train();
  torch::optim::SGD opt(block.parameters(), torch::optim::SGDOptions(0.1));
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    block.forward(at::randn({4, 32, 8, 8})).square().mean().backward();
    opt.step();
  }
  int changed = 0;
  for (const auto& p : block.named_parameters()) {
    if (p.key().find("bn") == std::string::npos &&
        p.key().find("downsample.1") == std::string::npos)
      continue;
    EXPECT_FALSE(at::equal(p.value(), before.at(p.key()))) << p.key() << " did not train";
    ++changed;
  }
  EXPECT_EQ(changed, 8);  // weight and bias of bn1..bn3 and the downsample's norm
  for (const auto& b : block.named_buffers())
    EXPECT_TRUE(at::equal(b.value(), before.at(b.key()))) << b.key() << " changed";
}

TEST(ResNetTest, BottleneckEqualsAtenConvAndEvalBatchNormReference) {
  at::manual_seed(7);
  for (const bool downsample : {false, true}) {
    SCOPED_TRACE(downsample);
    const int64_t in = downsample ? 24 : 32, stride = downsample ? 2 : 1;
    Bottleneck block(in, 8, stride, 6, 10);
    ASSERT_EQ(block.has_downsample(), downsample);
    auto p = block.named_parameters();
    auto b = block.named_buffers();
    {
      at::NoGradGuard no_grad;
      for (auto& t : p) {
        if (t.key().find("conv") == std::string::npos) t.value().uniform_(0.5, 1.5);
      }
      for (auto& t : b) {
        if (t.key().find("running_mean") != std::string::npos) t.value().normal_(0, 0.5);
        if (t.key().find("running_var") != std::string::npos) t.value().uniform_(0.5, 2.0);
      }
    }
    const auto bn = [&](const at::Tensor& x, const std::string& n) {
      return at::batch_norm(x, p[n + ".weight"], p[n + ".bias"], b[n + ".running_mean"],
                            b[n + ".running_var"], /*training=*/false, 0.1, 1e-5, false);
    };
    const at::Tensor x = at::randn({2, in, 6, 10});
    at::Tensor y = bn(at::conv2d(x, p["conv1.weight"]), "bn1").relu();
    y = bn(at::conv2d(y, p["conv2.weight"], {}, stride, 1), "bn2").relu();
    y = bn(at::conv2d(y, p["conv3.weight"]), "bn3");
    const at::Tensor skip =
        downsample ? bn(at::conv2d(x, p["downsample.0.weight"], {}, stride), "downsample.1") : x;
    const at::Tensor ref = (y + skip).relu();
    block.train();  // frozen: the same in training
    at::NoGradGuard no_grad;
    const at::Tensor out = block.forward(x);
    ASSERT_EQ(out.sizes(), ref.sizes());
    // fp32; the norm as (x - m) * rsqrt(v + eps) * w + b against x * s + t with s and t rounded
    // once: a few ulps of values of magnitude ~10 (sums over <= 72 inputs of O(1) products).
    EXPECT_LT((out - ref).abs().max().item<double>(), 1e-4 * (1 + ref.abs().max().item<double>()));
  }
}

// QAT's residual Add (train/qat): one "add_quantizer" shared by the conv branch and the skip, as
// ResidualConvBlock's; disabled it changes nothing, quantizing it fake-quantizes both summands.
TEST(ResNetTest, BottleneckAddQuantizerQuantizesBothSummands) {
  at::manual_seed(11);
  Bottleneck block(16, 4, 1, 6, 6);  // identity skip
  const at::Tensor x = at::randn({2, 16, 6, 6});
  at::NoGradGuard no_grad;
  block.eval();
  const at::Tensor plain = block.forward(x);
  block.add_quantizers();
  EXPECT_TRUE(block.quantized());
  EXPECT_EQ(block.named_buffers().find("add_quantizer.amax")->sizes(), (at::IntArrayRef{1}));
  EXPECT_THROW(block.add_quantizers(), Error);
  EXPECT_TRUE(at::equal(block.forward(x), plain));  // disabled: pass-through
  block.add_quantizer->freeze(at::full({1}, 2.0));
  const at::Tensor q = block.forward(x);
  const at::Tensor s = block.add_quantizer->scale();
  // Every output is relu(k1 s + k2 s) for integers k1, k2 (both summands on the one grid): a
  // multiple of the scale up to the float32 roundings of k s and of the sum (|k| <= 128).
  const at::Tensor levels = q / s;
  EXPECT_LT((levels - levels.round()).abs().max().item<double>(), 1e-3);
  EXPECT_FALSE(at::equal(q, plain));
}

TEST(ResNetTest, AnalyticFlopsMatchTheProfilerAndTorchvisionAt224) {
  at::manual_seed(9);
  ImageEncoderOptions o;
  o.backbone = "resnet50";
  o.image_h = 64;
  o.image_w = 96;
  o.out_channels = 32;
  ImageEncoder enc(o);
  const double profiled = testing::profiled_matmul_conv_flops([&] {
    at::NoGradGuard no_grad;
    (void)enc->forward(at::randn({1, 3, 64, 96}));
  });
  const Cost c = ImageEncoderImpl::analytic_cost(o);
  EXPECT_NEAR(profiled, c.flops, 1e-6 * c.flops);
  EXPECT_EQ(c.params, count_parameters(*enc));
  double units = 0;
  for (double f : ImageEncoderImpl::unit_flops(o)) units += f;
  EXPECT_NEAR(units, c.flops, 1e-9 * c.flops);
  // The trunk at 224 x 224: the multiply-adds of torchvision resnet50's convolutions,
  // 4,087,136,256 (the quoted 4.09 GMACs; fvcore's 4.11 adds the fc, norms and pooling).
  EXPECT_DOUBLE_EQ(ResNetImpl::analytic_cost(50, 224, 224).flops, 2.0 * 4'087'136'256.0);
}

TEST(ResNetTest, ImageSizeNotDivisibleBy32IsAConfigErrorNamingBackboneAndSize) {
  core::SceneSpec s = small_scene();
  s.image_height = 48;  // divisible by 16, not by 32
  try {
    (void)make_bev_spec(bev_config("resnet101"), s);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("model.backbone"), std::string::npos) << m;
    EXPECT_NE(m.find("resnet101"), std::string::npos) << m;
    EXPECT_NE(m.find("48x128"), std::string::npos) << m;
  }
}

// A tensor-parallel group the model never gets to use: the refusal comes first.
class NoTp : public units::TpLayers {
 public:
  int size() const override { return 2; }
  bool sequence_parallel() const override { return false; }
  units::LinearFactory linear_factory() override { return dense_linear; }
  void mark_sequence_parallel(const at::Tensor&) override {}
  at::Tensor scatter_to_sequence(const at::Tensor& x) override { return x; }
  at::Tensor gather_from_sequence(const at::Tensor& x, int64_t) override { return x; }
};

TEST(ResNetTest, TensorParallelIsAConfigErrorNamingTpAndTheBackbone) {
  try {
    (void)build_model(bev_config("resnet50"), small_scene(), std::make_shared<NoTp>());
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("parallel.tp"), std::string::npos) << m;
    EXPECT_NE(m.find("model.backbone=resnet50"), std::string::npos) << m;
    EXPECT_NE(m.find("TP splits ViT blocks only"), std::string::npos) << m;
  }
}

// The activation model: the encoder's four units, each bottleneck an inner recomputable block, and
// recompute keeping only the blocks' inputs.
TEST(ResNetTest, ActivationModelHasTheFourUnitsAndRecomputesBottlenecks) {
  units::ShapeOnlyScope shape_only;
  auto model = build_model(bev_config("resnet50"), small_scene());
  ActivationQuery q;
  const auto acts = model->unit_activations(q);
  ASSERT_EQ(acts.size(), model->units().size());
  const std::vector<std::size_t> inner = {3, 4, 6, 3};
  for (std::size_t u = 0; u < 4; ++u) {
    EXPECT_EQ(acts[u].inner.size(), inner[u]) << u;
    EXPECT_FALSE(acts[u].recomputable);
  }
  // Outputs: C2, C3, C4 and the feature map, fp32, two cameras of 64 x 128.
  EXPECT_DOUBLE_EQ(acts[0].output, 2.0 * 256 * 16 * 32 * 4);
  EXPECT_DOUBLE_EQ(acts[2].output, 2.0 * 1024 * 4 * 8 * 4);
  EXPECT_DOUBLE_EQ(acts[3].output, 2.0 * 64 * 4 * 8 * 4);
  std::vector<bool> wrapped;
  const auto none = model->saved_activations(q, Recompute::kNone, &wrapped);
  const auto full = model->saved_activations(q, Recompute::kFull, &wrapped);
  for (std::size_t u = 0; u < 4; ++u) {
    EXPECT_TRUE(wrapped[u]);
    EXPECT_LT(full[u], none[u]);
  }
  // layer2 under full recompute keeps its four bottlenecks' inputs: C2, then C3 three times.
  EXPECT_DOUBLE_EQ(full[1], 2.0 * 4 * (256 * 16 * 32 + 3 * 512 * 8 * 16));
}

}  // namespace
}  // namespace parallax::models
