// The FP8 kernels on a GPU: the fused amax and cast kernels give ATen's composition bit for bit,
// and the FP8 linear's forward and both gradients (cuBLASLt's FP8 GEMMs through _scaled_mm) stay
// within derived bounds of the product of its dequantized operands and of the bf16 layer.
// Skipped without a GPU of compute capability 8.9 or newer.
#include "kernels/fp8.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

using namespace parallax;
namespace f8 = parallax::kernels::fp8;

namespace {

bool fp8_gpu() {
  return torch::cuda::is_available() && f8::fp8_device_blocker(c10::Device(c10::kCUDA, 0)).empty();
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();
  return a.sizes() == b.sizes() &&
         at::equal(a.contiguous().view(at::kByte).cpu(), b.contiguous().view(at::kByte).cpu());
}

}  // namespace

TEST(Fp8CudaTest, FusedAmaxAndCastAreAtensBitForBit) {
  if (!fp8_gpu()) GTEST_SKIP() << "no GPU with FP8 tensor cores";
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (auto [rows, cols] :
         std::vector<std::pair<int64_t, int64_t>>{{37, 64}, {50, 20}, {1000, 2304}, {4096, 768}}) {
      for (f8::Format f : {f8::Format::kE4M3, f8::Format::kE5M2}) {
        SCOPED_TRACE(std::string(c10::toString(dt)) + " " + std::to_string(rows) + "x" +
                     std::to_string(cols) + " " + f8::to_string(f));
        // Magnitudes over 2^-24 .. 2^6, so that subnormals, normals and saturation all occur.
        at::Tensor x = (at::exp2(at::rand({rows, cols}, cuda) * 30 - 24) *
                        (at::randint(0, 2, {rows, cols}, cuda) * 2 - 1))
                           .to(dt);
        const at::Tensor a_fused = f8::amax(x, true), a_aten = f8::amax(x, false);
        ASSERT_TRUE(at::equal(a_fused, a_aten));
        // Scale from a smaller amax than the tensor's: part of it saturates.
        const at::Tensor from = a_aten * 0.25;
        at::Tensor rec_fused = at::full({1}, 0.5f, cuda), rec_aten = rec_fused.clone();
        const f8::Casted c1 = f8::cast_to_fp8(x, from, f, true, true, 16, rec_fused, true);
        const f8::Casted c2 = f8::cast_to_fp8(x, from, f, true, true, 16, rec_aten, false);
        EXPECT_TRUE(same_bits(c1.data, c2.data));
        EXPECT_TRUE(same_bits(c1.data_t, c2.data_t));
        EXPECT_TRUE(same_bits(c1.inv_scale, c2.inv_scale));
        EXPECT_TRUE(at::equal(rec_fused, rec_aten));
        EXPECT_TRUE(at::equal(rec_fused, a_aten));
        // Column sums (the bias gradient) from the same cast, with and without the row-major
        // copy: the FP8 bytes do not change, and the sums are reproducible bit for bit. Against
        // ATen's sum: both are fp32 sums of the same `rows` exact terms in different orders,
        // each within (rows - 1) 2^-24 sum |x| of the exact sum (Higham, Thm 4.2).
        for (bool rowmajor : {true, false}) {
          const f8::Casted s1 = f8::cast_to_fp8(x, from, f, rowmajor, true, 16, {}, true, true);
          const f8::Casted s2 = f8::cast_to_fp8(x, from, f, rowmajor, true, 16, {}, true, true);
          const f8::Casted s3 = f8::cast_to_fp8(x, from, f, rowmajor, true, 16, {}, false, true);
          if (rowmajor) {
            EXPECT_TRUE(same_bits(s1.data, c2.data));
          }
          EXPECT_TRUE(same_bits(s1.data_t, c2.data_t));
          ASSERT_TRUE(s1.col_sum.defined() && s3.col_sum.defined());
          ASSERT_EQ(s1.col_sum.sizes(), at::IntArrayRef({cols}));
          EXPECT_TRUE(same_bits(s1.col_sum, s2.col_sum));
          const at::Tensor xd = x.to(at::kDouble);
          const at::Tensor bound = xd.abs().sum(0) * (2.0 * (rows - 1) * std::ldexp(1.0, -24));
          const at::Tensor err = (s1.col_sum.to(at::kDouble) - s3.col_sum.to(at::kDouble)).abs();
          EXPECT_TRUE((err <= bound).all().item<bool>())
              << "column sums: max excess " << (err - bound).max().item<double>();
        }
      }
    }
  }
  // NaN: the amax is NaN, and NaN elements stay NaN.
  at::Tensor x = at::randn({64, 64}, cuda).to(at::kBFloat16);
  x[3][5] = NAN;
  EXPECT_TRUE(std::isnan(f8::amax(x, true).item<float>()));
  const at::Tensor one = at::ones({1}, cuda);
  const f8::Casted c1 = f8::cast_to_fp8(x, one, f8::Format::kE4M3, true, false, 1, {}, true);
  const f8::Casted c2 = f8::cast_to_fp8(x, one, f8::Format::kE4M3, true, false, 1, {}, false);
  EXPECT_TRUE(same_bits(c1.data, c2.data));
}

// Forward and both gradients. Against the dequantized operands in fp64: the output and dX are bf16
// (unit roundoff 2^-8, and the bias may be added after a rounding of the product); dW is fp32.
// Hopper's FP8 MMA keeps partial sums to about 14 bits (DeepSeek-V3, section 3.3.2: "around 14
// bits"); cuBLAS without fast accumulation promotes them to fp32 every few MMAs, but a partial
// sum within one stretch still rounds at 2^-14, so every GEMM's accumulation error is bounded by
// (inner + 1) 2^-14 of the sum of |terms| (the first H200 run of this test exceeded an fp32
// accumulation bound, (inner + 1) 2^-24, by 2.4e-3 on dW of 37 rows, whose entries are of order 6).
// Against the bf16 layer (at::linear under bf16): each E4M3 operand is within 2^-4 relatively
// (3 mantissa bits) or 2^-10 / scale absolutely (subnormals) of its bf16 value.
TEST(Fp8CudaTest, LinearMatchesItsDequantizedProductAndTheBf16Layer) {
  if (!fp8_gpu()) GTEST_SKIP() << "no GPU with FP8 tensor cores";
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (auto [rows, k, n] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {37, 64, 48}, {3152, 768, 2304}, {3152, 3072, 768}}) {
    SCOPED_TRACE(std::to_string(rows) + "x" + std::to_string(k) + " -> " + std::to_string(n));
    const at::Tensor x0 = at::randn({rows, k}, cuda).to(at::kBFloat16);
    const at::Tensor w0 = at::randn({n, k}, cuda) * 0.02, b0 = at::randn({n}, cuda) * 0.1;
    const at::Tensor g = at::randn({rows, n}, cuda).to(at::kBFloat16);
    at::Tensor x = x0.clone().set_requires_grad(true), w = w0.clone().set_requires_grad(true),
               b = b0.clone().set_requires_grad(true);
    f8::Fp8Linear layer(f8::Fp8Options{});
    const at::Tensor y = layer->forward(x, w, b);
    y.backward(g);

    const auto dq = [](const f8::Casted& c) {
      return c.data.to(at::kDouble) * c.inv_scale.to(at::kDouble);
    };
    const f8::Casted cx = f8::cast_to_fp8(x0, f8::amax(x0), f8::Format::kE4M3, true, false);
    const f8::Casted cw = f8::cast_to_fp8(w0, f8::amax(w0), f8::Format::kE4M3, true, false);
    const f8::Casted cg = f8::cast_to_fp8(g, f8::amax(g), f8::Format::kE5M2, true, false);
    const at::Tensor qx = dq(cx), qw = dq(cw), qg = dq(cg);
    const double u16 = std::ldexp(1.0, -8);
    const at::Tensor prod = at::matmul(qx, qw.t());
    const at::Tensor y_ref = prod + b0.to(at::kBFloat16).to(at::kDouble);
    const at::Tensor y_abs = at::matmul(qx.abs(), qw.abs().t());
    const at::Tensor y_bound =
        (y_ref.abs() + prod.abs()) * u16 + y_abs * (k + 1) * std::ldexp(1.0, -14);
    const at::Tensor y_err = (y.to(at::kDouble) - y_ref).abs();
    EXPECT_TRUE((y_err <= y_bound).all().item<bool>())
        << "forward: max excess " << (y_err - y_bound).max().item<double>();

    const at::Tensor dx_ref = at::matmul(qg, qw);
    const at::Tensor dx_bound =
        dx_ref.abs() * u16 + at::matmul(qg.abs(), qw.abs()) * (n + 1) * std::ldexp(1.0, -14);
    const at::Tensor dx_err = (x.grad().to(at::kDouble) - dx_ref).abs();
    EXPECT_TRUE((dx_err <= dx_bound).all().item<bool>())
        << "dx: max excess " << (dx_err - dx_bound).max().item<double>();
    const at::Tensor dw_ref = at::matmul(qg.t(), qx);
    const at::Tensor dw_bound =
        at::matmul(qg.abs().t(), qx.abs()) * (rows + 16) * std::ldexp(1.0, -14) +
        dw_ref.abs() * std::ldexp(1.0, -24);
    const at::Tensor dw_err = (w.grad().to(at::kDouble) - dw_ref).abs();
    EXPECT_TRUE((dw_err <= dw_bound).all().item<bool>())
        << "dw: max excess " << (dw_err - dw_bound).max().item<double>();
    // The bias gradient: g's column sums (from the cast kernel), an fp32 sum of `rows` exact terms,
    // within (rows - 1) 2^-24 sum |g| of the exact sum; fp32 like b.
    const at::Tensor gd = g.to(at::kDouble);
    const at::Tensor db_err = (b.grad().to(at::kDouble) - gd.sum(0)).abs();
    const at::Tensor db_bound = gd.abs().sum(0) * ((rows - 1) * std::ldexp(1.0, -24));
    EXPECT_TRUE((db_err <= db_bound).all().item<bool>())
        << "db: max excess " << (db_err - db_bound).max().item<double>();

    // Against the bf16 layer: y16 = x W^T + b with bf16 operands, accumulated in fp32 and rounded
    // once to bf16. Both are compared with `exact` (the bf16 operands' product in fp64):
    //   |y - exact|   <= |y - y_ref| + sum_k (|x| ew + ex |w| + ex ew)   (FP8 operand errors ex,
    //   ew) |y16 - exact| <= u16 (|exact| + acc) + acc,  acc = (K + 1) 2^-24 sum_k |x| |w|.
    const at::Tensor xd = x0.to(at::kDouble), wd = w0.to(at::kBFloat16).to(at::kDouble);
    const at::Tensor y16 = at::linear(x0, w0.to(at::kBFloat16), b0.to(at::kBFloat16));
    const at::Tensor exact = at::matmul(xd, wd.t()) + b0.to(at::kBFloat16).to(at::kDouble);
    const at::Tensor xe = xd.abs() / 16 + cx.inv_scale.to(at::kDouble) * std::ldexp(1.0, -10);
    const at::Tensor we = wd.abs() / 16 + cw.inv_scale.to(at::kDouble) * std::ldexp(1.0, -10);
    const at::Tensor acc = at::matmul(xd.abs(), wd.abs().t()) * (k + 1) * std::ldexp(1.0, -24);
    const at::Tensor lin_bound = y_bound + at::matmul(xd.abs(), we.t()) +
                                 at::matmul(xe, wd.abs().t()) + at::matmul(xe, we.t()) +
                                 (exact.abs() + acc) * u16 + acc;
    const at::Tensor lin_err = (y.to(at::kDouble) - y16.to(at::kDouble)).abs();
    EXPECT_TRUE((lin_err <= lin_bound).all().item<bool>())
        << "vs bf16: max excess " << (lin_err - lin_bound).max().item<double>();
    const double rel = (lin_err.norm() / y16.to(at::kDouble).norm()).item<double>();
    std::printf("fp8 vs bf16 %lldx%lld->%lld: normwise relative difference %.4f\n",
                static_cast<long long>(rows), static_cast<long long>(k), static_cast<long long>(n),
                rel);
  }
}

// The GELU kernel between two FP8 layers (f8::gelu): forward and backward against ATen's gelu and
// gelu_backward, and the amax it hands the next layer equal to that layer's own amax pass. Both
// evaluate the same fp32 formula (erff, expf) and round once to the dtype: the fp32 values agree
// to a few ulps (2^-21 relatively; erff and expf are within 2 ulps, the rest is the same sequence
// of roundings), and the stored values then to one ulp of the dtype (2^-7 relatively for bf16,
// 2^-10 for fp16, 2^-20 for fp32 with the few-ulp slack). The backward's sum cdf + x pdf cancels
// for negative x, so its slack is relative to dy (|cdf| + |x pdf|), not to the result.
// n = 999: the scalar kernel; 768000: the vectorised one.
TEST(Fp8CudaTest, GeluKernelIsAtensGeluAndHandsOnTheAmax) {
  if (!fp8_gpu()) GTEST_SKIP() << "no GPU with FP8 tensor cores";
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const double ulp = dt == at::kFloat
                           ? std::ldexp(1.0, -20)
                           : (dt == at::kHalf ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7));
    for (int64_t n : {999, 768000}) {
      SCOPED_TRACE(std::string(c10::toString(dt)) + " n=" + std::to_string(n));
      const at::Tensor p0 = (at::randn({n}, cuda) * 3).to(dt);
      const at::Tensor dh = at::randn({n}, cuda).to(dt);
      f8::Fp8Linear consumer(f8::Fp8Options{});
      at::Tensor pre = p0.clone().set_requires_grad(true);
      const at::Tensor h = f8::gelu(pre, nullptr, consumer.get());
      const at::Tensor handed = consumer->take_input_amax(h);
      ASSERT_TRUE(handed.defined());
      EXPECT_TRUE(at::equal(handed, f8::amax(h.detach(), false)));
      h.backward(dh);

      const at::Tensor pd = p0.to(at::kDouble);
      const at::Tensor h_ref = at::gelu(p0);
      const at::Tensor h_err = (h.detach().to(at::kDouble) - h_ref.to(at::kDouble)).abs();
      EXPECT_TRUE((h_err <= h_ref.to(at::kDouble).abs() * ulp).all().item<bool>())
          << "gelu: max excess "
          << (h_err - h_ref.to(at::kDouble).abs() * ulp).max().item<double>();
      const at::Tensor d_ref = at::gelu_backward(dh, p0);
      const at::Tensor cdf = 0.5 * (1 + at::erf(pd * M_SQRT1_2));
      const at::Tensor pdf = at::exp(-0.5 * pd * pd) * (M_2_SQRTPI * M_SQRT1_2 * 0.5);
      const at::Tensor d_bound = d_ref.to(at::kDouble).abs() * ulp + dh.to(at::kDouble).abs() *
                                                                         (cdf + pd.abs() * pdf) *
                                                                         std::ldexp(1.0, -19);
      const at::Tensor d_err = (pre.grad().to(at::kDouble) - d_ref.to(at::kDouble)).abs();
      EXPECT_TRUE((d_err <= d_bound).all().item<bool>())
          << "gelu backward: max excess " << (d_err - d_bound).max().item<double>();
      std::printf("gelu %s n=%lld: forward %lld, backward %lld of %lld values differ from ATen's\n",
                  c10::toString(dt), static_cast<long long>(n),
                  static_cast<long long>((h.detach() != h_ref).sum().item<int64_t>()),
                  static_cast<long long>((pre.grad() != d_ref).sum().item<int64_t>()),
                  static_cast<long long>(n));
    }
  }

  // Two FP8 layers around it, the W1 MLP's shapes: with the hand-offs and without (the layers'
  // own amax passes over the same tensors) every output and gradient is the same bit for bit.
  const int64_t rows = 3152, k = 768, hidden = 3072;
  const at::Tensor x0 = at::randn({rows, k}, cuda).to(at::kBFloat16);
  const at::Tensor w1 = at::randn({hidden, k}, cuda) * 0.02,
                   w2 = at::randn({k, hidden}, cuda) * 0.02;
  const at::Tensor g = at::randn({rows, k}, cuda).to(at::kBFloat16);
  std::vector<at::Tensor> out[2];
  int64_t taken[2] = {0, 0};
  for (int i = 0; i < 2; ++i) {
    f8::Fp8Linear l1(f8::Fp8Options{}), l2(f8::Fp8Options{});
    at::Tensor x = x0.clone().set_requires_grad(true), a = w1.clone().set_requires_grad(true),
               b = w2.clone().set_requires_grad(true);
    at::Tensor c1 = at::zeros({hidden}, cuda).set_requires_grad(true),
               c2 = at::zeros({k}, cuda).set_requires_grad(true);
    const at::Tensor h =
        f8::gelu(l1->forward(x, a, c1), i == 0 ? l1.get() : nullptr, i == 0 ? l2.get() : nullptr);
    const at::Tensor y = l2->forward(h, b, c2);
    y.backward(g);
    out[i] = {y, x.grad(), a.grad(), c1.grad(), b.grad(), c2.grad()};
    taken[i] = l1->hand_offs_taken() + l2->hand_offs_taken();
  }
  EXPECT_EQ(taken[0], 2);
  EXPECT_EQ(taken[1], 0);
  for (std::size_t j = 0; j < out[0].size(); ++j) EXPECT_TRUE(same_bits(out[0][j], out[1][j])) << j;
}

TEST(Fp8CudaTest, TensorsAtAnOddOffsetCastWithTheSameBits) {
  // A weight under ZeRO is a view into a flat buffer at any element offset. The vector kernels
  // load 16 bytes at a time, so the launchers give such a tensor the element-wise kernels: the
  // same bits as an aligned copy, and no "misaligned address" fault.
  if (!fp8_gpu()) GTEST_SKIP() << "no GPU with FP8 tensor cores";
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const int64_t rows = 96, cols = 64;
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dt));
    const at::Tensor flat = at::randn({1 + rows * cols}, cuda).to(dt);
    const at::Tensor x = flat.narrow(0, 1, rows * cols).view({rows, cols});
    ASSERT_NE(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16, 0u);
    const at::Tensor aligned = x.clone();
    const at::Tensor a = f8::amax(x, true);
    EXPECT_TRUE(at::equal(a, f8::amax(aligned, true)));
    const f8::Casted c1 = f8::cast_to_fp8(x, a, f8::Format::kE4M3, true, true, 16, {}, true);
    const f8::Casted c2 = f8::cast_to_fp8(aligned, a, f8::Format::kE4M3, true, true, 16, {}, true);
    torch::cuda::synchronize();  // a misaligned read is reported asynchronously
    EXPECT_TRUE(same_bits(c1.data, c2.data));
    EXPECT_TRUE(same_bits(c1.data_t, c2.data_t));
    EXPECT_TRUE(same_bits(c1.inv_scale, c2.inv_scale));
  }
}

TEST(Fp8CudaTest, FoldedGeluIsTheGeluThenTheLayerBitForBit) {
  // Fp8LinearImpl::forward_gelu (the delayed recipe's fc2 casting gelu(pre) itself) against
  // gelu() then forward(), W1's MLP shapes: the output, d pre, dW, dB and the recorded amaxes are
  // the same bits (the cast computes gelu(pre) rounded to bf16, as the GELU kernel writes it).
  if (!fp8_gpu()) GTEST_SKIP() << "no GPU with FP8 tensor cores";
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const int64_t rows = 3152, k = 768, hidden = 3072;
  const at::Tensor p0 = (at::randn({rows, hidden}, cuda) * 2).to(at::kBFloat16);
  const at::Tensor w0 = at::randn({k, hidden}, cuda) * 0.02;
  const at::Tensor g = at::randn({rows, k}, cuda).to(at::kBFloat16);
  f8::Fp8Options o;
  o.recipe = f8::Recipe::kDelayed;
  o.amax_history = 2;
  std::vector<at::Tensor> out[2];
  for (int i = 0; i < 2; ++i) {
    f8::Fp8Linear l(o), producer(o);
    for (auto* m : {l.get(), producer.get()}) {
      m->to(at::kCUDA);
      m->amax_history.fill_(4.f);
      m->history_loaded();
    }
    ASSERT_TRUE(l->folds_gelu());
    at::Tensor pre = p0.clone().set_requires_grad(true), w = w0.clone().set_requires_grad(true);
    at::Tensor b = at::zeros({k}, cuda).set_requires_grad(true);
    const at::Tensor y = i == 0 ? l->forward_gelu(pre, w, b, producer.get())
                                : l->forward(f8::gelu(pre, producer.get(), l.get()), w, b);
    y.backward(g);
    torch::cuda::synchronize();
    out[i] = {y, pre.grad(), w.grad(), b.grad(), l->step_amax.clone()};
  }
  const char* names[] = {"y", "d pre", "dW", "dB", "recorded amaxes"};
  for (int j = 0; j < 5; ++j) EXPECT_TRUE(same_bits(out[0][j], out[1][j])) << names[j];
}
