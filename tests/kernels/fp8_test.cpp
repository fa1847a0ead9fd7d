// FP8 scaling and the FP8 linear on the CPU (ATen's composition and ATen's CPU _scaled_mm): the
// scale, the saturating round-to-nearest-even casts and their round trips against the reference
// of fp8_ref.h, the transposed and padded operand, the delayed recipe's history, and the layer's
// forward and both gradients against the product of its dequantized operands.
#include "kernels/fp8.h"
#include "tests/kernels/fp8_ref.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <cmath>
#include <cstdint>
#include <vector>

using namespace parallax;
namespace f8 = parallax::kernels::fp8;
namespace ref = parallax::testing::fp8;
using f8::Casted;

namespace {

constexpr f8::Format kFormats[] = {f8::Format::kE4M3, f8::Format::kE5M2};

// The FP8 tensor's bytes.
std::vector<uint8_t> bits_of(const at::Tensor& q) {
  const at::Tensor b = q.contiguous().view(at::kByte);
  return std::vector<uint8_t>(b.data_ptr<uint8_t>(), b.data_ptr<uint8_t>() + b.numel());
}

// The dequantized operand (value / scale) in fp64.
at::Tensor dequant(const at::Tensor& q, const at::Tensor& inv_scale) {
  return q.to(at::kDouble) * inv_scale.to(at::kDouble);
}

}  // namespace

TEST(Fp8Test, AtensFp8DtypesDecodeLikeTheSpecification) {
  for (f8::Format f : kFormats) {
    const bool e4m3 = f == f8::Format::kE4M3;
    const at::Tensor all = at::arange(256, at::kInt).to(at::kByte).view(f8::scalar_type(f));
    const at::Tensor as_double = all.to(at::kDouble);
    for (int b = 0; b < 256; ++b) {
      const double want = ref::decode(static_cast<uint8_t>(b), e4m3);
      const double got = as_double[b].item<double>();
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << f8::to_string(f) << " bits " << b;
      } else {
        EXPECT_EQ(got, want) << f8::to_string(f) << " bits " << b;
      }
    }
    double largest = 0;
    for (int b = 0; b < 256; ++b) {
      const double d = ref::decode(static_cast<uint8_t>(b), e4m3);
      if (std::isfinite(d)) largest = std::max(largest, d);
    }
    EXPECT_EQ(largest, f8::max_finite(f));
  }
}

TEST(Fp8Test, ScaleIsMaxOverAmaxWithAFloor) {
  const at::Tensor a = at::tensor({3.5f});
  EXPECT_EQ(f8::scale_from_amax(a, f8::Format::kE4M3).item<float>(), 448.f / 3.5f);
  EXPECT_EQ(f8::scale_from_amax(a, f8::Format::kE5M2).item<float>(), 57344.f / 3.5f);
  // An all-zero tensor: the floor keeps the scale finite (torchao's EPS).
  EXPECT_EQ(f8::scale_from_amax(at::zeros({1}), f8::Format::kE4M3).item<float>(),
            448.f / f8::kAmaxFloor);
  EXPECT_TRUE(std::isnan(f8::scale_from_amax(at::tensor({NAN}), f8::Format::kE4M3).item<float>()));
}

TEST(Fp8Test, AmaxIsTheLargestMagnitudeAndKeepsNaN) {
  at::Tensor x = at::randn({33, 70});
  x[7][9] = -11.25f;
  EXPECT_EQ(f8::amax(x).item<float>(), 11.25f);
  EXPECT_EQ(f8::amax(x.to(at::kBFloat16)).item<float>(), 11.25f);
  EXPECT_EQ(f8::amax(at::zeros({5, 16})).item<float>(), 0.f);
  x[30][1] = NAN;
  EXPECT_TRUE(std::isnan(f8::amax(x).item<float>()));
}

// x * scale in fp32, then the reference's saturating round to nearest even, element by element,
// for values spread over the whole range (normals, subnormals, ties, beyond the largest value).
TEST(Fp8Test, CastRoundsToNearestEvenAndSaturates) {
  for (f8::Format f : kFormats) {
    const bool e4m3 = f == f8::Format::kE4M3;
    const float fmax = f8::max_finite(f);
    // Log-uniform magnitudes over 2^-20 .. 2^4 of random sign, and exact midpoints between
    // neighbouring FP8 values (ties), at amax 7 (scale = fmax / 7).
    at::Tensor x = at::exp2(at::rand({64, 48}) * 24 - 20) * (at::randint(0, 2, {64, 48}) * 2 - 1);
    const float amax_value = 7.f;
    const float scale = fmax / amax_value;
    for (int i = 0; i < 40; ++i) {
      // Midpoint of codes (b, b + 1), both finite and positive, divided by the scale.
      const int b = 1 + (i * 3) % (e4m3 ? 0x7d : 0x7a);
      const double mid = (ref::decode(static_cast<uint8_t>(b), e4m3) +
                          ref::decode(static_cast<uint8_t>(b + 1), e4m3)) /
                         2;
      x[0][i] = static_cast<float>(mid / scale);
    }
    x[1][0] = 9.f;    // beyond amax: saturates at fmax
    x[1][1] = -1e6f;  // far beyond
    x[1][2] = NAN;
    const Casted c = f8::cast_to_fp8(x, at::tensor({amax_value}), f, true, false, 1, {}, false);
    const std::vector<uint8_t> got = bits_of(c.data);
    const at::Tensor xs = x.contiguous();
    for (int64_t i = 0; i < x.numel(); ++i) {
      const float product = xs.data_ptr<float>()[i] * scale;  // fp32, as the cast computes it
      const uint8_t want = ref::round_saturated(product, e4m3);
      if (std::isnan(product)) {
        EXPECT_TRUE(std::isnan(ref::decode(got[i], e4m3))) << f8::to_string(f) << " element " << i;
      } else {
        ASSERT_EQ(got[i], want) << f8::to_string(f) << " element " << i
                                << ": x * scale = " << product;
      }
    }
    EXPECT_EQ(ref::decode(got[48], e4m3), fmax);
    EXPECT_EQ(ref::decode(got[49], e4m3), -fmax);
    EXPECT_EQ(c.inv_scale.item<float>(), 1.f / scale);
  }
}

// Every finite FP8 value, cast at scale 1 (amax = fmax), comes back as itself.
TEST(Fp8Test, EveryFiniteValueRoundTripsExactly) {
  for (f8::Format f : kFormats) {
    const bool e4m3 = f == f8::Format::kE4M3;
    std::vector<float> values;
    std::vector<uint8_t> codes;
    for (int b = 0; b < 256; ++b) {
      const double d = ref::decode(static_cast<uint8_t>(b), e4m3);
      if (!std::isfinite(d)) continue;
      values.push_back(static_cast<float>(d));
      codes.push_back(static_cast<uint8_t>(b));
    }
    const at::Tensor x = at::tensor(values).view({1, -1});
    const Casted c =
        f8::cast_to_fp8(x, at::tensor({f8::max_finite(f)}), f, true, false, 1, {}, false);
    EXPECT_EQ(c.inv_scale.item<float>(), 1.f);
    EXPECT_EQ(bits_of(c.data), codes) << f8::to_string(f);
  }
}

TEST(Fp8Test, TransposeIsPaddedWithZerosToTheGranule) {
  const at::Tensor x = at::randn({37, 24});
  const at::Tensor a = f8::amax(x);
  const Casted c = f8::cast_to_fp8(x, a, f8::Format::kE4M3, true, true, 16, {}, false);
  ASSERT_EQ(c.data_t.sizes(), (std::vector<int64_t>{24, 48}));
  EXPECT_EQ(bits_of(c.data_t.narrow(1, 0, 37)), bits_of(c.data.t()));
  for (uint8_t b : bits_of(c.data_t.narrow(1, 37, 11))) ASSERT_EQ(b, 0);
  // Recording the amax as the cast goes: max-accumulated into amax_out.
  at::Tensor rec = at::tensor({0.5f});
  f8::cast_to_fp8(x, a, f8::Format::kE4M3, false, true, 16, rec, false);
  EXPECT_EQ(rec.item<float>(), a.item<float>());
}

// The layer's forward and both gradients against the same arithmetic on its dequantized operands
// in fp64: the GEMMs' layouts, transposes and scales are right if these agree to the output's
// rounding. Bounds: y and dx are bf16 (unit roundoff 2^-8; y's bias may be added after the
// product was rounded, a second rounding of at most 2^-8 |x W^T|) of an fp32 accumulation over K
// (resp. N) terms (<= K 2^-24 of the sum of |terms|); dW is fp32 over M terms. And against the
// unquantized fp64 product: each E4M3 operand is within 2^-4 relatively of its value for normals
// (3 mantissa bits) and within half the subnormal spacing (2^-10 / scale) below, E5M2 within 2^-3
// and 2^-17 / scale.
TEST(Fp8Test, LinearForwardAndGradientsMatchTheDequantizedProduct) {
  const int64_t k = 64, n = 48;
  for (int64_t rows : {37, 64}) {  // 37: the weight gradient pads its inner dimension
    SCOPED_TRACE(rows);
    at::Tensor x = (at::randn({rows, k}) * 2).set_requires_grad(true);
    at::Tensor w = (at::randn({n, k}) * 0.05).set_requires_grad(true);
    at::Tensor b = at::randn({n}).set_requires_grad(true);
    f8::Fp8Options o;
    f8::Fp8Linear layer(o);
    const at::Tensor y = layer->forward(x, w, b);
    ASSERT_EQ(y.scalar_type(), at::kBFloat16);
    const at::Tensor g = at::randn({rows, n});
    y.backward(g.to(at::kBFloat16));

    const Casted cx = f8::cast_to_fp8(x.detach(), f8::amax(x.detach()), f8::Format::kE4M3, true,
                                      false, 1, {}, false);
    const Casted cw = f8::cast_to_fp8(w.detach(), f8::amax(w.detach()), f8::Format::kE4M3, true,
                                      false, 1, {}, false);
    const at::Tensor g16 = g.to(at::kBFloat16);
    const Casted cg =
        f8::cast_to_fp8(g16, f8::amax(g16), f8::Format::kE5M2, true, false, 1, {}, false);
    const at::Tensor qx = dequant(cx.data, cx.inv_scale), qw = dequant(cw.data, cw.inv_scale),
                     qg = dequant(cg.data, cg.inv_scale);

    // The bias enters in bf16, as at::linear's under autocast.
    const at::Tensor y_ref = at::matmul(qx, qw.t()) + b.detach().to(at::kBFloat16).to(at::kDouble);
    const at::Tensor y_abs = at::matmul(qx.abs(), qw.abs().t()) + b.detach().abs().to(at::kDouble);
    const at::Tensor y_bound = (y_ref.abs() + at::matmul(qx, qw.t()).abs()) * std::ldexp(1.0, -8) +
                               y_abs * (k + 1) * std::ldexp(1.0, -24);
    EXPECT_TRUE(((y.to(at::kDouble) - y_ref).abs() <= y_bound).all().item<bool>())
        << "forward: max excess "
        << ((y.to(at::kDouble) - y_ref).abs() - y_bound).max().item<double>();

    const at::Tensor dx_ref = at::matmul(qg, qw);
    const at::Tensor dx_bound = dx_ref.abs() * std::ldexp(1.0, -8) +
                                at::matmul(qg.abs(), qw.abs()) * n * std::ldexp(1.0, -24);
    EXPECT_TRUE(((x.grad().to(at::kDouble) - dx_ref).abs() <= dx_bound).all().item<bool>())
        << "dx: max excess "
        << ((x.grad().to(at::kDouble) - dx_ref).abs() - dx_bound).max().item<double>();
    ASSERT_EQ(w.grad().scalar_type(), at::kFloat);
    const at::Tensor dw_ref = at::matmul(qg.t(), qx);
    const at::Tensor dw_bound =
        at::matmul(qg.abs().t(), qx.abs()) * (rows + 1) * std::ldexp(1.0, -24);
    EXPECT_TRUE(((w.grad().to(at::kDouble) - dw_ref).abs() <= dw_bound).all().item<bool>())
        << "dw: max excess "
        << ((w.grad().to(at::kDouble) - dw_ref).abs() - dw_bound).max().item<double>();
    // The bias gradient is the bf16 gradient summed in fp32 (exactly representable addends).
    const at::Tensor db_ref = g16.to(at::kDouble).sum(0);
    EXPECT_TRUE(
        at::allclose(b.grad().to(at::kDouble), db_ref, 0,
                     rows * std::ldexp(1.0, -24) * db_ref.abs().max().item<double>() + 1e-30));

    // Against the unquantized operands (the quantization error itself, bounded above).
    const auto quant_bound = [](const at::Tensor& v, const at::Tensor& inv, double rel,
                                double sub_exp) {
      return v.abs() * rel + inv.to(at::kDouble) * std::ldexp(1.0, static_cast<int>(sub_exp));
    };
    const at::Tensor ex = quant_bound(x.detach().to(at::kDouble), cx.inv_scale, 1.0 / 16, -10);
    const at::Tensor ew = quant_bound(w.detach().to(at::kDouble), cw.inv_scale, 1.0 / 16, -10);
    EXPECT_TRUE(((qx - x.detach().to(at::kDouble)).abs() <= ex).all().item<bool>());
    EXPECT_TRUE(((qw - w.detach().to(at::kDouble)).abs() <= ew).all().item<bool>());
    const at::Tensor eg = quant_bound(g16.to(at::kDouble), cg.inv_scale, 1.0 / 8, -17);
    EXPECT_TRUE(((qg - g16.to(at::kDouble)).abs() <= eg).all().item<bool>());
  }
}

TEST(Fp8Test, LinearRefusesShapesOffTheGranule) {
  f8::Fp8Linear layer(f8::Fp8Options{});
  EXPECT_FALSE(f8::fp8_linear_supported(40, 48));
  EXPECT_TRUE(f8::fp8_linear_supported(64, 48));
  EXPECT_THROW(layer->forward(at::randn({4, 40}), at::randn({48, 40})), Error);
  EXPECT_THROW(f8::parse_recipe("tensorwise", "precision.fp8.recipe"), ConfigError);
  EXPECT_NE(f8::fp8_device_blocker(c10::Device(c10::kCPU)).find("cpu"), std::string::npos);
}

// Delayed recipe: the first step scales by the current amax and records it; each roll pushes the
// step's amaxes (after the reducer, called once for all layers) into column 0; later steps scale
// by the history's max, so an input smaller than the history's saturates nothing and one larger
// saturates.
TEST(Fp8Test, DelayedRecipeScalesFromTheHistory) {
  f8::Fp8Options o;
  o.recipe = f8::Recipe::kDelayed;
  o.amax_history = 3;
  f8::Fp8Linear a(o), b(o);
  ASSERT_EQ(a->amax_history.sizes(), (std::vector<int64_t>{3, 3}));
  f8::Fp8Linear current(f8::Fp8Options{});
  const at::Tensor w = (at::randn({32, 16}) * 0.1).set_requires_grad(true);
  int reductions = 0;
  int64_t reduced_numel = 0;
  const f8::AmaxReducer reducer = [&](at::Tensor& t) {
    ++reductions;
    reduced_numel = t.numel();
  };
  std::vector<float> input_amax;
  for (int step = 0; step < 5; ++step) {
    const float s = std::pow(2.f, static_cast<float>(step % 3));
    const at::Tensor x = at::randn({20, 16}) * s;
    input_amax.push_back(f8::amax(x).item<float>());
    const at::Tensor y = a->forward(x, w);
    if (step == 0) {
      EXPECT_FALSE(a->initialized());
      EXPECT_TRUE(at::equal(y, current->forward(x, w))) << "step 1 scales like the current recipe";
    } else {
      // The scale the layer used: from the history's largest input amax.
      const float hist = a->amax_history[0].max().item<float>();
      const Casted cx =
          f8::cast_to_fp8(x, at::tensor({hist}), f8::Format::kE4M3, true, false, 1, {}, false);
      const Casted cw = f8::cast_to_fp8(w.detach(), a->history_amax.narrow(0, 1, 1),
                                        f8::Format::kE4M3, true, false, 1, {}, false);
      const at::Tensor want = at::_scaled_mm(cx.data, cw.data.t(), cx.inv_scale, cw.inv_scale,
                                             std::nullopt, std::nullopt, at::kBFloat16, true);
      EXPECT_TRUE(at::equal(y, want)) << "step " << step + 1;
    }
    y.sum().backward();
    w.mutable_grad().reset();
    b->forward(x, w);  // a second layer: one reduction covers both
    f8::roll_histories({a.get(), b.get(), current.get()}, reducer);
    EXPECT_TRUE(a->initialized());
    EXPECT_EQ(a->amax_history[0][0].item<float>(), input_amax.back());
    EXPECT_EQ(a->step_amax.abs().sum().item<float>(), 0.f);
  }
  EXPECT_EQ(reductions, 5);
  EXPECT_EQ(reduced_numel, 6);  // 3 amaxes of each delayed layer; the current one has none
  // Three columns: steps 5, 4, 3.
  for (int c = 0; c < 3; ++c)
    EXPECT_EQ(a->amax_history[0][c].item<float>(), input_amax[static_cast<std::size_t>(4 - c)]);
  // A layer without gradients records no gradient amax (b only ran forward).
  EXPECT_EQ(b->amax_history[2].abs().sum().item<float>(), 0.f);
  // The state reloads: initialized follows the history.
  b->amax_history.zero_();
  b->history_loaded();
  EXPECT_FALSE(b->initialized());
  b->amax_history.copy_(a->amax_history);
  b->history_loaded();
  EXPECT_TRUE(b->initialized());
  EXPECT_TRUE(at::equal(b->history_amax, a->amax_history.amax(1)));
}

namespace {

// fc2(gelu(fc1(x))) with two FP8 layers, and every gradient: through f8::gelu with the layers
// named (`hand_off`) or without (the layers compute their amaxes themselves). `between` is applied
// to the GELU's output before fc2 (identity: none).
struct MlpRun {
  at::Tensor y, dx, dw1, db1, dw2, db2;
};
MlpRun run_mlp(f8::Fp8Linear& l1, f8::Fp8Linear& l2, const at::Tensor& x0, const at::Tensor& w1,
               const at::Tensor& w2, const at::Tensor& g, bool hand_off,
               at::Tensor (*between)(const at::Tensor&) = nullptr) {
  at::Tensor x = x0.clone().set_requires_grad(true);
  at::Tensor a = w1.clone().set_requires_grad(true), b = w2.clone().set_requires_grad(true);
  at::Tensor c1 = at::zeros({w1.size(0)}).set_requires_grad(true);
  at::Tensor c2 = at::zeros({w2.size(0)}).set_requires_grad(true);
  at::Tensor h =
      f8::gelu(l1->forward(x, a, c1), hand_off ? l1.get() : nullptr, hand_off ? l2.get() : nullptr);
  if (between != nullptr) h = between(h);
  const at::Tensor y = l2->forward(h, b, c2);
  y.backward(g);
  return {y, x.grad(), a.grad(), c1.grad(), b.grad(), c2.grad()};
}

}  // namespace

// The GELU between two FP8 layers hands fc2 the amax of its input and fc1 the amax of its output
// gradient, from the kernel that wrote each (on a GPU; here ATen's gelu and amax). The amax is the
// one the layer would compute itself, so every output and gradient is the same bit for bit, and
// each layer takes exactly one hand-off per step. A tensor between the GELU and fc2 (a dropout)
// is not the handed one: no hand-off is taken, and nothing changes. Under the delayed recipe,
// once a step is rolled the scales come from the histories and nothing is handed.
TEST(Fp8Test, GeluBetweenFp8LayersHandsEachLayerTheAmaxItWouldCompute) {
  const int64_t rows = 37, k = 64, hidden = 128;
  const at::Tensor x = (at::randn({rows, k}) * 2).to(at::kBFloat16);
  const at::Tensor w1 = at::randn({hidden, k}) * 0.05, w2 = at::randn({k, hidden}) * 0.05;
  const at::Tensor g = at::randn({rows, k}).to(at::kBFloat16);
  f8::Fp8Linear l1(f8::Fp8Options{}), l2(f8::Fp8Options{}), r1(f8::Fp8Options{}),
      r2(f8::Fp8Options{});
  const MlpRun fused = run_mlp(l1, l2, x, w1, w2, g, true);
  const MlpRun plain = run_mlp(r1, r2, x, w1, w2, g, false);
  EXPECT_EQ(l1->hand_offs_taken(), 1);  // its output gradient's amax
  EXPECT_EQ(l2->hand_offs_taken(), 1);  // its input's amax
  EXPECT_EQ(r1->hand_offs_taken() + r2->hand_offs_taken(), 0);
  for (auto [a, b] : {std::pair{fused.y, plain.y},
                      {fused.dx, plain.dx},
                      {fused.dw1, plain.dw1},
                      {fused.db1, plain.db1},
                      {fused.dw2, plain.dw2},
                      {fused.db2, plain.db2}}) {
    ASSERT_TRUE(a.defined() && b.defined());
    EXPECT_TRUE(at::equal(a, b));
  }
  // The GELU itself: ATen's.
  const at::Tensor pre = at::randn({rows, hidden}).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(f8::gelu(pre, nullptr, nullptr), at::gelu(pre)));

  // A dropout-like op between: a new tensor, so fc2 computes its own amax.
  f8::Fp8Linear d1(f8::Fp8Options{}), d2(f8::Fp8Options{});
  const MlpRun between =
      run_mlp(d1, d2, x, w1, w2, g, true, [](const at::Tensor& h) { return h * 1.0; });
  EXPECT_EQ(d2->hand_offs_taken(), 0);
  EXPECT_EQ(d1->hand_offs_taken(), 1);  // fc1 still gets the GELU backward's own output
  EXPECT_TRUE(at::equal(between.y, plain.y));
  EXPECT_TRUE(at::equal(between.dw1, plain.dw1));

  // Delayed: the first step scales by current amaxes (hand-offs taken), later ones do not.
  f8::Fp8Options delayed;
  delayed.recipe = f8::Recipe::kDelayed;
  f8::Fp8Linear e1(delayed), e2(delayed);
  run_mlp(e1, e2, x, w1, w2, g, true);
  EXPECT_EQ(e1->hand_offs_taken() + e2->hand_offs_taken(), 2);
  f8::roll_histories({e1.get(), e2.get()}, {});
  run_mlp(e1, e2, x, w1, w2, g, true);
  EXPECT_EQ(e1->hand_offs_taken() + e2->hand_offs_taken(), 2);
}
