// QAT (models/quant.h, train/qat/qat.h): the fake-quant arithmetic and its straight-through
// gradient, the calibrators on known distributions, the quantizers' placement on bev tiny, and the
// calibration of a whole model. One process, CPU, fp32. The trainer-level behaviour (PTQ and QAT
// through the CLI, DDP, resume, the config errors) is tests/train/test_qat.py.
#include "train/qat/qat.h"

#include "core/error.h"
#include "models/layers.h"
#include "models/perception_model.h"
#include "models/vit.h"
#include "train/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <vector>

using namespace parallax;
using models::QuantState;

namespace {

// The reference arithmetic, element by element in float32 as ONNX QuantizeLinear /
// DequantizeLinear define it (and ONNX Runtime computes it): the scale amax / 127 rounded to float,
// the float quotient x / s, nearbyint (ties to even, the default rounding mode), the clamp to
// [-128, 127], and the product with the scale.
float reference_fq(float x, float amax) {
  const float s = amax / 127.0f;
  const float q = std::fmin(std::fmax(std::nearbyint(x / s), -128.0f), 127.0f);
  return q * s;
}

bool inside(float x, float amax) {
  const float s = amax / 127.0f;
  const float q = std::nearbyint(x / s);
  return q >= -128.0f && q <= 127.0f;
}

std::shared_ptr<models::Model> bev_tiny() {
  models::ModelConfig mc;
  mc.name = "bev";
  mc.size = "tiny";
  mc.backbone = "conv";
  return models::build_model(mc, models::benchmark_scene("tiny"));
}

}  // namespace

TEST(QatTest, PerTensorFakeQuantEqualsTheReferenceMathExactly) {
  at::manual_seed(11);
  models::TensorQuantizer q(0);
  const float amax = 1.7f;
  q->freeze(at::full({}, amax));
  ASSERT_EQ(q->state(), QuantState::kQuantizing);
  // Values on both sides of the range, and exact multiples of the scale and half-steps (ties).
  const float s = amax / 127.0f;
  at::Tensor x = at::cat({at::randn({4000}) * 1.5, at::arange(-140, 140).to(at::kFloat) * s,
                          (at::arange(-140, 140).to(at::kFloat) + 0.5) * s});
  const at::Tensor y = q->forward(x);
  const float* px = x.data_ptr<float>();
  const float* py = y.data_ptr<float>();
  int64_t clipped = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    ASSERT_EQ(py[i], reference_fq(px[i], amax)) << "x = " << px[i];
    clipped += !inside(px[i], amax);
  }
  EXPECT_GT(clipped, 100) << "the draw must exercise the saturation";
  // The extremes: -128 s and 127 s.
  EXPECT_EQ(q->forward(at::full({1}, -10.f)).item<float>(), -128.0f * s);
  EXPECT_EQ(q->forward(at::full({1}, 10.f)).item<float>(), 127.0f * s);
}

// ATen's fake_quantize_per_tensor_affine multiplies by the float reciprocal of the scale; for some
// x, x * (1 / s) rounds to a float on the other side of a rounding boundary than x / s, and the
// quantizer then differed by one step from ONNX Runtime's QuantizeLinear (the QAT export's parity
// gate failed on such flips, spread by the layers after them). The quantizer must divide.
TEST(QatTest, FakeQuantDividesByTheScaleAsOnnxQuantizeLinear) {
  const float amax = 1.7f, s = amax / 127.0f, inv = 1.0f / s;
  // Values a few ulps around every half-step: where the two roundings can disagree.
  std::vector<float> xs;
  for (int k = -128; k < 127; ++k) {
    float x = (static_cast<float>(k) + 0.5f) * s;
    for (int u = 0; u < 4; ++u) x = std::nextafter(x, -INFINITY);
    for (int u = 0; u < 9; ++u, x = std::nextafter(x, INFINITY)) {
      if (std::nearbyint(x * inv) != std::nearbyint(x / s)) xs.push_back(x);
    }
  }
  ASSERT_GT(xs.size(), 10u) << "no value where x * (1 / s) and x / s round apart";
  models::TensorQuantizer q(0);
  q->freeze(at::full({}, amax));
  const at::Tensor x = at::tensor(xs, at::kFloat);
  const at::Tensor y = q->forward(x);
  for (int64_t i = 0; i < x.numel(); ++i)
    ASSERT_EQ(y[i].item<float>(), reference_fq(xs[static_cast<size_t>(i)], amax))
        << "x = " << xs[static_cast<size_t>(i)];
  // The same values per channel (a weight quantizer) and through the autograd path.
  models::TensorQuantizer qc(1);
  qc->freeze(at::full({1}, amax));
  const at::Tensor yc = qc->forward(x.view({1, -1}).clone().requires_grad_(true)).detach();
  EXPECT_TRUE(at::equal(yc.view({-1}), y));
}

TEST(QatTest, PerChannelFakeQuantUsesOneScalePerOutputChannel) {
  at::manual_seed(12);
  const at::Tensor w = at::randn({6, 4, 3, 3});
  models::TensorQuantizer q(6);
  const at::Tensor amax = models::weight_amax(w);
  EXPECT_TRUE(at::equal(amax, w.abs().reshape({6, -1}).amax(1)));
  q->freeze(amax * 0.8);  // some weights clip
  const at::Tensor y = q->forward(w);
  const at::Tensor a = q->amax.contiguous();
  for (int64_t c = 0; c < 6; ++c) {
    const at::Tensor wc = w[c].contiguous(), yc = y[c].contiguous();
    const float ac = a[c].item<float>();
    for (int64_t i = 0; i < wc.numel(); ++i)
      ASSERT_EQ(yc.data_ptr<float>()[i], reference_fq(wc.data_ptr<float>()[i], ac));
  }
}

TEST(QatTest, StraightThroughGradientIsOneInsideTheRangeAndZeroOutside) {
  at::manual_seed(13);
  const float amax = 0.9f;
  for (int64_t channels : {0, 3}) {
    models::TensorQuantizer q(channels);
    q->freeze(channels > 0 ? at::full({channels}, amax) : at::full({}, amax));
    at::Tensor x = (at::randn({3, 500}) * 0.8).requires_grad_(true);
    const at::Tensor g = at::randn({3, 500});
    (q->forward(x) * g).sum().backward();
    const at::Tensor xd = x.detach().contiguous();
    const at::Tensor gx = x.grad().contiguous();
    int64_t out = 0;
    for (int64_t i = 0; i < xd.numel(); ++i) {
      const bool in = inside(xd.data_ptr<float>()[i], amax);
      out += !in;
      ASSERT_EQ(gx.data_ptr<float>()[i], in ? g.contiguous().data_ptr<float>()[i] : 0.0f)
          << "channels " << channels << ", x = " << xd.data_ptr<float>()[i];
    }
    EXPECT_GT(out, 50);
  }
}

TEST(QatTest, DisabledAndCalibratingQuantizersPassTheInputThrough) {
  at::manual_seed(14);
  models::TensorQuantizer q(0);
  const at::Tensor x = at::randn({64});
  EXPECT_TRUE(at::equal(q->forward(x), x));
  q->begin_pass(models::CalibPass::kMax);
  EXPECT_TRUE(at::equal(q->forward(x), x));
}

TEST(QatTest, MaxCalibratorGivesTheMaxOfAbsoluteValues) {
  at::manual_seed(15);
  models::TensorQuantizer q(0);
  q->begin_pass(models::CalibPass::kMax);
  const at::Tensor a = at::randn({1000}), b = at::randn({10, 10}) * 3;
  q->forward(a);
  q->forward(b);
  EXPECT_EQ(q->calib_max().item<float>(),
            std::max(a.abs().max().item<float>(), b.abs().max().item<float>()));
  // Per channel (axis 0).
  models::TensorQuantizer qc(4);
  qc->begin_pass(models::CalibPass::kMax);
  const at::Tensor c = at::randn({4, 50});
  qc->forward(c);
  EXPECT_TRUE(at::equal(qc->calib_max(), c.abs().amax(1)));
}

TEST(QatTest, PercentileOfALargeGaussianIsWithinOneBinOfTheEmpiricalPercentile) {
  at::manual_seed(16);
  const int64_t n = 2000000;
  const at::Tensor x = at::randn({n});
  const double range = x.abs().max().item<double>();
  models::TensorQuantizer q(0);
  q->begin_pass(models::CalibPass::kHistogram, range);
  q->forward(x.narrow(0, 0, n / 2));
  q->forward(x.narrow(0, n / 2, n / 2));
  EXPECT_DOUBLE_EQ(q->histogram().sum().item<double>(), static_cast<double>(n));
  const double amax = models::percentile_amax(q->histogram(), range, 99.99);
  // The empirical 99.99th percentile of |x|: the ceil(0.9999 n)-th smallest. The calibrator
  // returns the upper edge of the bin that holds it, so it lies in (amax - width, amax]; histc's
  // bin edges are computed in float32, so allow one float32 ulp of the range on each side.
  const at::Tensor sorted = std::get<0>(x.abs().sort());
  const auto k = static_cast<int64_t>(std::ceil(0.9999 * static_cast<double>(n)));
  const double emp = sorted[k - 1].item<double>();
  const double width = range / models::kHistogramBins;
  const double ulp = range * std::ldexp(1.0, -23);
  EXPECT_LE(emp, amax + ulp);
  EXPECT_GT(emp, amax - width - ulp);
  // And the distribution's: P(|x| > 3.8906) = 1e-4 for a standard normal. The sample quantile's
  // standard deviation is sqrt(p (1 - p) / n) / f(q), f = 2 phi(3.8906) = 4.2e-4: 0.017; with the
  // bin width (range / 2048 ~ 0.0026) 0.1 is over 5 standard deviations.
  EXPECT_NEAR(amax, 3.8906, 0.1);
}

TEST(QatTest, MseCalibratorOnAUniformDistributionIsNearTheMax) {
  at::manual_seed(17);
  const at::Tensor x = at::rand({1000000}) * 2 - 1;
  const double range = x.abs().max().item<double>();
  models::TensorQuantizer q(0);
  q->begin_pass(models::CalibPass::kHistogram, range);
  q->forward(x);
  const double amax = models::mse_amax(q->histogram(), range);
  // |x| is uniform on [0, 1]. Clipping at a costs (1 - a)^3 / 3; rounding with step a / 127 costs
  // at most (a / 127)^2 / 12 = 5.2e-6 at a = 1. So any a with (1 - a)^3 / 3 > 5.2e-6, i.e.
  // a < 0.975, is worse than a = 1 by the clipping term alone: the minimiser is in [0.975, 1]
  // (the continuous optimum is 1 - 0.0032). 0.97 leaves room for the histogram's bin centres.
  EXPECT_LE(amax, range);
  EXPECT_GE(amax, 0.97 * range);
  // A standard Gaussian, unlike the uniform, is clipped well inside its max (~4.9 for 1e6 draws):
  // the MSE-optimal clip of a uniform 8-bit quantizer of N(0, 1) is 3.92 (Banner et al., "Post
  // training 4-bit quantization", 2019, table of optimal clipping values; their 256 levels over
  // [-a, a] against our 255 change it by far less than the tolerance). 0.1 covers the bin width
  // (~0.0024), the sampling noise of the tail counts and the flat objective near the optimum.
  const at::Tensor g = at::randn({1000000});
  const double grange = g.abs().max().item<double>();
  models::TensorQuantizer qg(0);
  qg->begin_pass(models::CalibPass::kHistogram, grange);
  qg->forward(g);
  const double gamax = models::mse_amax(qg->histogram(), grange);
  EXPECT_NEAR(gamax, 3.92, 0.1);
  EXPECT_LT(gamax, 0.9 * grange);
}

TEST(QatTest, ApplyQuantizesEveryLinearAndConvButTheSkippedAndKeepsParameterNames) {
  auto model = bev_tiny();
  std::vector<std::string> before;
  for (const auto& it : model->named_parameters()) before.push_back(it.key());
  train::QatConfig cfg;
  cfg.enabled = true;
  cfg.skip = {"heads"};
  int64_t skipped = 0;
  const auto ls = train::qat::apply(*model, cfg, &skipped);
  EXPECT_EQ(skipped, 6);  // seg/heat/reg conv (ConvNormAct) and out
  std::set<std::string> paths;
  for (const auto& l : ls) {
    paths.insert(l.path);
    EXPECT_FALSE(l.path.rfind("heads.", 0) == 0) << l.path;
  }
  EXPECT_TRUE(paths.count("view.lift1") && paths.count("view.lift2")) << *paths.begin();
  std::vector<std::string> after;
  for (const auto& it : model->named_parameters()) after.push_back(it.key());
  EXPECT_EQ(before, after) << "QAT must not rename or add parameters";
  int64_t amax_buffers = 0;
  for (const auto& it : model->named_buffers())
    amax_buffers += it.key().size() > 5 && it.key().substr(it.key().size() - 5) == ".amax";
  int64_t adds = 0;
  for (const auto& l : ls) adds += l.is_add();
  EXPECT_GT(adds, 0) << "bev_tiny's residual conv blocks";
  EXPECT_EQ(amax_buffers, 2 * static_cast<int64_t>(ls.size()) - adds);
}

TEST(QatTest, AResidualAddQuantizesBothInputsWithOneSharedScale) {
  at::manual_seed(21);
  models::ResidualConvBlock block(8, 6, 6);
  const at::Tensor x = at::randn({2, 8, 6, 6}) * 3;
  at::NoGradGuard g;
  std::map<std::string, std::shared_ptr<torch::nn::Module>> child;
  for (const auto& it : block.named_children()) child[it.key()] = it.value();
  auto conv = [&](const char* name, const at::Tensor& in) {
    return std::dynamic_pointer_cast<models::ConvNormActImpl>(child.at(name))->forward(in);
  };
  const at::Tensor y = conv("conv2", conv("conv1", x));
  block.add_quantizers();
  EXPECT_THROW(block.add_quantizers(), Error);
  // Calibrating: the max |.| over both summands; the output is still the fp32 block's.
  block.add_quantizer->begin_pass(models::CalibPass::kMax);
  EXPECT_TRUE(at::equal(block.forward_impl(x), (y + x).relu()));
  const double amax = std::max(x.abs().max().item<double>(), y.abs().max().item<double>());
  EXPECT_EQ(block.add_quantizer->calib_max().item<double>(), static_cast<float>(amax));
  // Quantizing: relu(fq(y) + fq(x)), both with the one scale amax / 127; reference_fq's float
  // arithmetic, so exact.
  block.add_quantizer->freeze(block.add_quantizer->calib_max().clone());
  const float a = static_cast<float>(block.add_quantizer->amax.item<double>());
  const float s = a / 127.0f;
  auto fq = [&](const at::Tensor& t) { return (t / s).round().clamp(-128, 127) * s; };
  EXPECT_TRUE(at::equal(block.forward_impl(x), (fq(y) + fq(x)).relu()));
  EXPECT_FALSE(at::equal(block.forward_impl(x), (y + x).relu())) << "quantization changed nothing";
}

// qat.learn_scales (LSQ): amax is a parameter; the loss sum(w * y) gives it
// sum_i w_i * dy_i/ds * g / 127 (s = amax / 127), dy/ds = nearbyint(x / s) - x / s inside the
// range and the saturated level outside, g = 1 / sqrt(n * 127) with n the elements per scale.
// The reference sums the same float32 quotients in float64. ATen rounds each term (the level minus
// the quotient, the product with the output's gradient: 2u), sums n = 250 of them in float32 in
// any order (gamma_n), then scales by g and divides by 127 (2u): within (n + 4) u of sum |terms|
// (tests/TOLERANCES.md, "The model"); the bound below is (n + 8) u.
TEST(QatTest, LearnedScalesGetTheLsqGradientPerTensorAndPerChannel) {
  at::manual_seed(29);
  for (const int64_t channels : {int64_t{0}, int64_t{4}}) {
    SCOPED_TRACE(channels ? "per channel" : "per tensor");
    models::TensorQuantizer q(channels, /*learn_scales=*/true);
    EXPECT_TRUE(q->amax.requires_grad());
    EXPECT_EQ(q->named_parameters().size(), 1u);
    EXPECT_EQ(q->named_buffers().size(), 0u);
    const int64_t c = channels ? channels : 1;
    const at::Tensor amax = at::rand({c}) + 1.0;
    q->freeze(amax);
    const at::Tensor x = (at::randn({c, 250}) * 1.5).requires_grad_(true);
    const at::Tensor w = at::randn({c, 250});
    (q->forward(x) * w).sum().backward();
    ASSERT_TRUE(q->amax.grad().defined());
    const float* px = x.data_ptr<float>();
    const float* pw = w.data_ptr<float>();
    const float* pg = x.grad().data_ptr<float>();
    const double n = channels ? 250.0 : static_cast<double>(x.numel());
    const double g = 1.0 / std::sqrt(n * 127.0);
    std::vector<double> want(static_cast<std::size_t>(c), 0), mag(static_cast<std::size_t>(c), 0);
    int64_t clipped = 0;
    for (int64_t i = 0; i < x.numel(); ++i) {
      const int64_t ch = channels ? i / 250 : 0;
      const float s = amax[ch].item<float>() / 127.0f;
      const float xs = px[i] / s;
      const float level = std::nearbyint(xs);
      const bool in = level >= -128.0f && level <= 127.0f;
      clipped += !in;
      const double dyds =
          in ? static_cast<double>(level) - xs : std::fmin(std::fmax(level, -128), 127);
      const double term = static_cast<double>(pw[i]) * dyds * g / 127.0;
      want[static_cast<std::size_t>(ch)] += term;
      mag[static_cast<std::size_t>(ch)] += std::fabs(term);
      ASSERT_EQ(pg[i], in ? pw[i] : 0.0f) << "the input's gradient stays the clipped STE";
    }
    EXPECT_GT(clipped, 10);
    for (int64_t k = 0; k < c; ++k) {
      EXPECT_NEAR(q->amax.grad()[k].item<double>(), want[static_cast<std::size_t>(k)],
                  (250 + 8) * std::ldexp(1.0, -24) * mag[static_cast<std::size_t>(k)])
          << "scale " << k;
    }
  }
  // A frozen (buffer) amax gets none.
  models::TensorQuantizer frozen(0);
  EXPECT_FALSE(frozen->amax.requires_grad());
}

// qat.attention: the inputs of the two attention matmuls (q, k, v, and the softmax output p), one
// per-tensor quantizer each. Quantizing, the attention is fq(softmax(fq(q) fq(k)^T / sqrt(hd)))
// fq(v): the reference below runs the same ATen matmuls and softmax on the same strided views (so
// the same floats reach each quantizer) and quantizes with reference_fq's float arithmetic, so
// the two agree exactly. Disabled, the module is bitwise the unquantized one (SDPA).
TEST(QatTest, AttentionQuantizesTheMatmulInputsAndSoftmaxOutput) {
  at::manual_seed(23);
  models::TransformerBlockOptions o;
  o.dim = 32;
  o.heads = 4;
  o.mlp_hidden = 64;
  o.tokens = 10;
  models::Attention attn(o);
  const at::Tensor x = at::randn({2, 10, 32}) * 2;
  at::NoGradGuard g;
  const at::Tensor fp32 = attn->forward(x);
  attn->add_quantizers();
  EXPECT_THROW(attn->add_quantizers(), Error);
  EXPECT_TRUE(at::equal(attn->forward(x), fp32)) << "disabled quantizers must change nothing";
  // The pieces, as the forward makes them.
  std::map<std::string, std::shared_ptr<torch::nn::Module>> child;
  for (const auto& it : attn->named_children()) child[it.key()] = it.value();
  auto linear = [&](const char* name, const at::Tensor& in) {
    return std::dynamic_pointer_cast<models::DenseLinearImpl>(child.at(name))->forward(in);
  };
  const at::Tensor parts = linear("qkv", x).view({2, 10, 3, 4, 8}).permute({2, 0, 3, 1, 4});
  const at::Tensor q = parts[0], k = parts[1], v = parts[2];
  const double inv = 1.0 / std::sqrt(8.0);
  // Calibrating: pass-through (the explicit math, so within rounding of SDPA), and each quantizer
  // sees its input.
  models::TensorQuantizer* qs[] = {&attn->q_quantizer, &attn->k_quantizer, &attn->v_quantizer,
                                   &attn->p_quantizer};
  for (auto* qz : qs) (*qz)->begin_pass(models::CalibPass::kMax);
  // Explicit float32 math against SDPA's (another blocking of the same sums): the scores' dot
  // products (K = 8) and the output's (K = 10 tokens, then proj's K = 32) each within gamma_K of
  // their magnitudes, which are O(1) to O(10) here: a few 1e-6 at most; 1e-5 (rtol and atol)
  // holds that with margin, and a wrong path (no scale, unnormalised p) is off by O(1).
  EXPECT_TRUE(at::allclose(attn->forward(x), fp32, 1e-5, 1e-5));
  const at::Tensor p = at::softmax(at::matmul(q, k.transpose(-2, -1)).mul(inv), -1, at::kFloat);
  EXPECT_EQ(attn->q_quantizer->calib_max().item<float>(), q.abs().max().item<float>());
  EXPECT_EQ(attn->k_quantizer->calib_max().item<float>(), k.abs().max().item<float>());
  EXPECT_EQ(attn->v_quantizer->calib_max().item<float>(), v.abs().max().item<float>());
  EXPECT_EQ(attn->p_quantizer->calib_max().item<float>(), p.abs().max().item<float>());
  for (auto* qz : qs) (*qz)->freeze((*qz)->calib_max().clone());
  auto fq = [](const at::Tensor& t, float amax) {
    at::Tensor c = t.contiguous().clone();
    float* d = c.data_ptr<float>();
    for (int64_t i = 0; i < c.numel(); ++i) d[i] = reference_fq(d[i], amax);
    return c;
  };
  auto amax = [](models::TensorQuantizer& qz) { return qz->amax.item<float>(); };
  const at::Tensor fq_q = fq(q, amax(attn->q_quantizer)), fq_k = fq(k, amax(attn->k_quantizer)),
                   fq_v = fq(v, amax(attn->v_quantizer));
  const at::Tensor pq =
      fq(at::softmax(at::matmul(fq_q, fq_k.transpose(-2, -1)).mul(inv), -1, at::kFloat),
         amax(attn->p_quantizer));
  // The model's p_quantizer input is a softmax of the model's own fq(q) fq(k)^T (contiguous
  // outputs of fake_quantize, as here).
  const at::Tensor want = linear("proj", at::matmul(pq, fq_v).transpose(1, 2).reshape({2, 10, 32}));
  const at::Tensor got = attn->forward(x);
  EXPECT_TRUE(at::equal(got, want)) << "max diff " << (got - want).abs().max().item<double>();
  EXPECT_FALSE(at::allclose(got, fp32, 1e-4, 1e-4)) << "quantization changed nothing";
  // The softmax output's grid is amax_p / 127: every level of fq(p) is a multiple of it.
  const at::Tensor levels = pq / (amax(attn->p_quantizer) / 127.0f);
  EXPECT_TRUE(at::allclose(levels, levels.round(), 0, 1e-3));
}

// qat.attention on a ViT backbone: four layers per attention (q, k, v, p; kind kAttention, path
// "<attention>.<input>"), in the units of their blocks; a glob naming the attention skips its
// inputs with its qkv and proj; without qat.attention none.
TEST(QatTest, AttentionLayersBelongToTheirBlocksAndSkipByTheAttentionsPath) {
  models::ModelConfig mc;
  mc.name = "bev";
  mc.size = "tiny";
  mc.backbone = "vit";
  auto count = [](const std::vector<train::qat::Layer>& ls) {
    int64_t n = 0;
    for (const auto& l : ls) n += l.kind == train::qat::Layer::Kind::kAttention;
    return n;
  };
  train::QatConfig cfg;
  {
    auto model = models::build_model(mc, models::benchmark_scene("tiny"));
    EXPECT_EQ(count(train::qat::apply(*model, cfg)), 0);
  }
  auto model = models::build_model(mc, models::benchmark_scene("tiny"));
  int64_t attentions = 0;
  for (const auto& m : model->modules(false))
    attentions += dynamic_cast<models::AttentionImpl*>(m.get()) != nullptr;
  ASSERT_GT(attentions, 1);
  cfg.attention = true;
  const auto ls = train::qat::apply(*model, cfg);
  EXPECT_EQ(count(ls), 4 * attentions);
  std::set<std::string> params;
  for (const auto& it : model->named_parameters()) params.insert(it.key());
  std::set<std::string> buffers;
  for (const auto& it : model->named_buffers()) buffers.insert(it.key());
  std::set<std::string> unit_params;
  for (const auto& u : model->units())
    unit_params.insert(u.param_names.begin(), u.param_names.end());
  for (const auto& l : ls) {
    EXPECT_TRUE(params.count(l.unit_param()) && unit_params.count(l.unit_param())) << l.path;
    if (l.kind != train::qat::Layer::Kind::kAttention) continue;
    const std::string which = l.path.substr(l.path.rfind('.') + 1);
    EXPECT_TRUE(which == "q" || which == "k" || which == "v" || which == "p") << l.path;
    EXPECT_EQ(l.module_path() + "." + which, l.path);
    EXPECT_TRUE(buffers.count(l.path + "_quantizer.amax")) << l.path;
    EXPECT_FALSE(l.input->per_channel());
  }
  // Skipping one attention by its path: its four inputs, its qkv and proj.
  const std::string first =
      ls[static_cast<std::size_t>(std::find_if(ls.begin(), ls.end(),
                                               [](const auto& l) {
                                                 return l.kind ==
                                                        train::qat::Layer::Kind::kAttention;
                                               }) -
                                  ls.begin())]
          .module_path();
  cfg.skip = {first};
  auto again = models::build_model(mc, models::benchmark_scene("tiny"));
  int64_t skipped = 0;
  const auto ls2 = train::qat::apply(*again, cfg, &skipped);
  EXPECT_EQ(skipped, 3) << "the attention, its qkv and its proj";
  EXPECT_EQ(ls2.size(), ls.size() - 6);
  for (const auto& l : ls2) EXPECT_NE(l.module_path().rfind(first, 0), 0u) << l.path;
}

TEST(QatTest, ASkipGlobThatMatchesNothingIsRefusedNamingTheKey) {
  auto model = bev_tiny();
  train::QatConfig cfg;
  cfg.skip = {"heads", "*.nothing"};
  try {
    train::qat::apply(*model, cfg);
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("key 'qat.skip': '*.nothing' matches no"),
              std::string::npos)
        << e.what();
  }
}

// qat.calib_select=hardest: the pool's highest fp32 losses, highest first, ties to the earlier
// batch; a NaN loss or an impossible count is one ConfigError naming it.
TEST(QatTest, HardestPicksTheHighestLossesAndBreaksTiesByStreamOrder) {
  EXPECT_EQ(train::qat::hardest({1, 5, 3, 5, 2}, 2), (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(train::qat::hardest({1, 5, 3, 5, 2}, 3), (std::vector<int64_t>{1, 3, 2}));
  EXPECT_EQ(train::qat::hardest({4, 4, 4}, 2), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(train::qat::hardest({-1, -3}, 2), (std::vector<int64_t>{0, 1}));
  auto error = [](const std::vector<double>& l, int64_t k) {
    try {
      train::qat::hardest(l, k);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error({1, NAN, 2}, 1).find("pool batch 2 (of 3) is nan"), std::string::npos)
      << error({1, NAN, 2}, 1);
  EXPECT_NE(error({1, 2}, 3).find("3 calibration batches cannot be chosen from a pool of 2"),
            std::string::npos);
  train::QatConfig cfg;
  cfg.calib_batches = 8;
  EXPECT_EQ(train::qat::calib_pool(cfg), 160);  // the top 5%
  cfg.calib_pool = 8;
  EXPECT_EQ(train::qat::calib_pool(cfg), 8);
  cfg.calib_pool = 7;
  EXPECT_THROW(train::qat::calib_pool(cfg), ConfigError);
}

// Calibrating with calib_select=hardest draws the whole pool, and every amax is then the one that
// calibrating on exactly the highest-loss batches gives (bit for bit: the same forwards on the
// same batches), for the max and the histogram calibrators; twice the same.
TEST(QatTest, HardestCalibratesOnTheHighestLossBatchesOfThePool) {
  constexpr int64_t kPool = 6, kChosen = 2;
  for (const char* calibrator : {"max", "mse"}) {
    SCOPED_TRACE(calibrator);
    at::manual_seed(21);
    auto model = bev_tiny();
    model->eval();
    std::vector<core::TensorDict> pool;
    std::vector<double> losses;
    for (int64_t i = 0; i < kPool; ++i) {
      at::manual_seed(100 + i);
      pool.push_back(model->example_batch(1));
      at::NoGradGuard g;
      losses.push_back(model->loss(pool.back(), model->forward(pool.back())).total.item<double>());
    }
    std::vector<int64_t> top = train::qat::hardest(losses, kChosen);
    ASSERT_NE(top, (std::vector<int64_t>{0, 1})) << "the pool's first batches are its hardest: the "
                                                    "test could not tell the selections apart";
    std::sort(top.begin(), top.end());
    const std::vector<double> sorted_losses = [&] {
      auto l = losses;
      std::sort(l.rbegin(), l.rend());
      return l;
    }();
    auto run = [&](const std::string& select, const std::vector<int64_t>& stream, int* drawn,
                   std::map<std::string, double>* metrics) {
      at::manual_seed(21);  // the same weights as `model`
      auto m = bev_tiny();
      train::QatConfig cfg;
      cfg.calibrator = calibrator;
      cfg.calib_batches = kChosen;
      cfg.calib_select = select;
      cfg.calib_pool = kPool;
      const auto ls = train::qat::apply(*m, cfg);
      const comm::CommPtr none;
      const train::TrainingStart start{
          *m,
          false,
          none,
          c10::Device(c10::kCPU),
          [&] {
            return pool[static_cast<std::size_t>(stream[static_cast<std::size_t>((*drawn)++)])];
          },
          [&](const core::TensorDict& b) { return m->forward(b); }};
      *metrics = train::qat::calibrate(ls, cfg, start);
      return train::qat::amax_fingerprint(ls);
    };
    int drawn = 0;
    std::map<std::string, double> mh, mh2, mf;
    const std::string hard = run("hardest", {0, 1, 2, 3, 4, 5}, &drawn, &mh);
    EXPECT_EQ(drawn, kPool);
    drawn = 0;
    EXPECT_EQ(run("hardest", {0, 1, 2, 3, 4, 5}, &drawn, &mh2), hard) << "not deterministic";
    drawn = 0;
    EXPECT_EQ(run("first", top, &drawn, &mf), hard)
        << "hardest did not calibrate on batches " << top[0] << " and " << top[1];
    EXPECT_EQ(drawn, kChosen);
    drawn = 0;
    EXPECT_NE(run("first", {0, 1, 2, 3, 4, 5}, &drawn, &mf), hard)
        << "the first two calibrate alike";
    EXPECT_EQ(mh.at("calib_pool"), kPool);
    // The model's loss on the same batch, recomputed inside calibrate(): the same ops, bitwise.
    EXPECT_EQ(mh.at("calib_loss_min"), sorted_losses[kChosen - 1]);
    EXPECT_GT(mh.at("calib_loss_min"), mh.at("calib_pool_loss_mean"));
  }
}

TEST(QatTest, CalibrationFreezesEveryQuantizerAndTheModelStaysCloseToFp32) {
  at::manual_seed(18);
  for (const char* calibrator : {"max", "percentile", "mse"}) {
    auto model = bev_tiny();
    model->eval();
    const core::TensorDict batch = model->example_batch(2);
    at::Tensor ref;
    {
      at::NoGradGuard g;
      ref = model->forward(batch).at("bev_logits").clone();
    }
    train::QatConfig cfg;
    cfg.calibrator = calibrator;
    cfg.calib_batches = 2;
    const auto ls = train::qat::apply(*model, cfg);
    {
      at::NoGradGuard g;  // quantizers added, still disabled: the forward is unchanged
      EXPECT_TRUE(at::equal(model->forward(batch).at("bev_logits"), ref));
    }
    model->train();
    int drawn = 0;
    const comm::CommPtr none;
    const train::TrainingStart start{*model,
                                     false,
                                     none,
                                     c10::Device(c10::kCPU),
                                     [&] {
                                       ++drawn;
                                       return batch;
                                     },
                                     [&](const core::TensorDict& b) { return model->forward(b); }};
    const auto m = train::qat::calibrate(ls, cfg, start);
    EXPECT_EQ(drawn, 2);
    EXPECT_TRUE(model->is_training()) << "calibration restores the training mode";
    EXPECT_EQ(m.at("calib_layers"), static_cast<double>(ls.size()));
    EXPECT_EQ(m.at("calib_unseen"), 0);
    for (const auto& l : ls) {
      EXPECT_EQ(l.input->state(), QuantState::kQuantizing) << l.path;
      if (l.weight) EXPECT_EQ(l.weight->state(), QuantState::kQuantizing) << l.path;
      EXPECT_GT(l.input->amax.item<float>(), 0) << l.path;
    }
    model->eval();
    at::NoGradGuard g;
    const at::Tensor out = model->forward(batch).at("bev_logits");
    EXPECT_FALSE(at::equal(out, ref)) << calibrator << ": quantization changed nothing";
    // INT8 on every layer of a random-weight model: a loose sanity bound (the outputs' relative
    // RMS error), not an accuracy claim; fp32 vs quantized differ by the accumulated rounding.
    const double rel = ((out - ref).square().mean() / ref.square().mean()).sqrt().item<double>();
    EXPECT_LT(rel, 0.2) << calibrator;
  }
}
