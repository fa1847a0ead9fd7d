#include "models/quant.h"

#include "core/error.h"
#include "units/param_init.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace parallax::models {

TensorQuantizerImpl::TensorQuantizerImpl(int64_t channels, bool learn_scales)
    : channels_(channels) {
  PARALLAX_CHECK(channels >= 0, Error, "TensorQuantizer: channels {} must be >= 0", channels);
  // [1] rather than a 0-dim tensor per tensor: checkpoints and weights.h5 hold 1-D shapes.
  at::Tensor init = units::init_zeros({channels > 0 ? channels : 1});
  amax = learn_scales ? register_parameter("amax", init) : register_buffer("amax", init);
}

void TensorQuantizerImpl::begin_pass(CalibPass pass, double range) {
  PARALLAX_CHECK(pass == CalibPass::kMax || range > 0, Error,
                 "TensorQuantizer: a histogram pass needs a positive range, got {}", range);
  state_ = QuantState::kCalibrating;
  pass_ = pass;
  hist_range_ = range;
  if (pass == CalibPass::kHistogram) hist_ = at::Tensor();
}

void TensorQuantizerImpl::freeze(const at::Tensor& amax_value) {
  {
    at::NoGradGuard no_grad;
    amax.copy_(amax_value.reshape(amax.sizes()));
  }
  state_ = QuantState::kQuantizing;
  calib_max_ = hist_ = at::Tensor();
  hist_range_ = 0;
}

at::Tensor TensorQuantizerImpl::scale() const {
  return amax.clamp_min(kMinAmax) / static_cast<double>(kQuantMax);
}

at::Tensor TensorQuantizerImpl::forward(const at::Tensor& x) {
  if (state_ == QuantState::kDisabled) return x;
  if (state_ == QuantState::kCalibrating) {
    at::NoGradGuard no_grad;
    const at::Tensor a = x.detach().abs().to(at::kFloat);
    if (pass_ == CalibPass::kMax) {
      const at::Tensor m = per_channel() ? a.reshape({a.size(0), -1}).amax(1) : a.max();
      calib_max_ = calib_max_.defined() ? at::maximum(calib_max_, m) : m;
    } else {
      // Values above the range (none, when the range is the max of pass 1 over the same
      // batches) would be dropped by histc: clamp them into the last bin instead.
      const at::Tensor h =
          at::histc(a.clamp_max(hist_range_), kHistogramBins, 0, hist_range_).to(at::kDouble);
      hist_ = hist_.defined() ? hist_ + h : h;
    }
    return x;
  }
  // Quantizing, in float32 (the scale is a float32 tensor on x's device, so no host sync).
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor s = scale();
  if (per_channel()) {
    std::vector<int64_t> shape(static_cast<std::size_t>(std::max<int64_t>(xf.dim(), 1)), 1);
    shape[0] = s.numel();
    s = s.reshape(shape);
  } else {
    s = s.reshape({});  // broadcasts to any x without changing its shape
  }
  if (observer_) {
    at::NoGradGuard no_grad;
    observer_(at::div(xf.detach(), s));
  }
  return fake_quantize(xf, s).to(x.scalar_type());
}

namespace {

// ONNX's QuantizeLinear -> DequantizeLinear (int8, zero point 0) on float32 `x` with the scale
// `s` (float32, broadcastable to x): q = saturate(round_half_to_even(x / s)), y = q * s. The
// quotient is a true division, as the ONNX spec defines it and ONNX Runtime computes it: ATen's
// fake_quantize_per_{tensor,channel}_affine multiply by a float reciprocal instead, and
// x * (1 / s) rounds to another float than x / s for some x, which then lands on the other side
// of a rounding boundary (a one-step difference that the layers after it spread).
// Backward: the straight-through estimator clipped to the range (models/quant.h).
// With `learn` (the scale requires a gradient) also LSQ's gradient for the scale (models/quant.h).
struct FakeQuantize : public torch::autograd::Function<FakeQuantize> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& s, bool learn) {
    const at::Tensor xs = at::div(x, s);
    const at::Tensor q = xs.round();  // round half to even (nearbyint)
    at::Tensor y = q.clamp(static_cast<double>(kQuantMin), static_cast<double>(kQuantMax));
    const at::Tensor inside = y.eq(q);  // inside the range: the gradient passes
    if (learn) {
      // d y / d s per element: the level minus x / s inside, the saturated level outside.
      ctx->save_for_backward({inside, y - xs.masked_fill(inside.logical_not(), 0)});
      ctx->saved_data["scale_sizes"] = s.sizes().vec();
      const double per_scale = static_cast<double>(x.numel()) / static_cast<double>(s.numel());
      ctx->saved_data["g"] = 1.0 / std::sqrt(per_scale * static_cast<double>(kQuantMax));
    } else {
      ctx->save_for_backward({inside});
    }
    return y.mul_(s);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor gx = grads[0].masked_fill(saved[0].logical_not(), 0);
    if (saved.size() < 2) return {gx, at::Tensor(), at::Tensor()};
    const auto sizes = ctx->saved_data["scale_sizes"].toIntVector();
    const at::Tensor gs = at::sum_to(grads[0].to(at::kFloat) * saved[1], c10::IntArrayRef(sizes)) *
                          ctx->saved_data["g"].toDouble();
    return {gx, gs, at::Tensor()};
  }
};

}  // namespace

at::Tensor fake_quantize(const at::Tensor& x, const at::Tensor& scale) {
  const bool learn = at::GradMode::is_enabled() && scale.requires_grad();
  if (learn || (at::GradMode::is_enabled() && x.requires_grad()))
    return FakeQuantize::apply(x, learn ? scale : scale.detach(), learn);
  return at::div(x, scale)
      .round_()
      .clamp_(static_cast<double>(kQuantMin), static_cast<double>(kQuantMax))
      .mul_(scale);
}

at::Tensor weight_amax(const at::Tensor& w) {
  at::NoGradGuard no_grad;
  return w.detach().abs().to(at::kFloat).reshape({w.size(0), -1}).amax(1);
}

namespace {

// Counts as float64 on the CPU, checked.
std::vector<double> host_counts(const at::Tensor& hist, double range) {
  PARALLAX_CHECK(hist.defined() && hist.numel() == kHistogramBins && range > 0, Error,
                 "calibrator: expected a histogram of {} bins over a positive range, got {} bins "
                 "over [0, {}]",
                 kHistogramBins, hist.defined() ? hist.numel() : 0, range);
  const at::Tensor h = hist.detach().to(at::kCPU, at::kDouble).contiguous();
  return std::vector<double>(h.data_ptr<double>(), h.data_ptr<double>() + h.numel());
}

}  // namespace

double percentile_amax(const at::Tensor& hist, double range, double percentile) {
  PARALLAX_CHECK(percentile > 0 && percentile <= 100, Error,
                 "percentile calibrator: percentile {} is not in (0, 100]", percentile);
  const std::vector<double> h = host_counts(hist, range);
  double total = 0;
  for (double c : h) total += c;
  if (total <= 0) return range;
  const double width = range / static_cast<double>(kHistogramBins);
  const double target = percentile / 100.0 * total;
  double cum = 0;
  for (int64_t i = 0; i < kHistogramBins; ++i) {
    cum += h[static_cast<std::size_t>(i)];
    if (cum >= target) return width * static_cast<double>(i + 1);
  }
  return range;
}

double mse_amax(const at::Tensor& hist, double range) {
  const std::vector<double> h = host_counts(hist, range);
  const double width = range / static_cast<double>(kHistogramBins);
  double total = 0;
  for (double c : h) total += c;
  if (total <= 0) return range;
  // Occupied bins only: the error sums over them.
  std::vector<double> centre, count;
  for (int64_t i = 0; i < kHistogramBins; ++i) {
    if (h[static_cast<std::size_t>(i)] <= 0) continue;
    centre.push_back(width * (static_cast<double>(i) + 0.5));
    count.push_back(h[static_cast<std::size_t>(i)]);
  }
  const at::Tensor c = at::from_blob(centre.data(), {static_cast<int64_t>(centre.size())},
                                     at::TensorOptions().dtype(at::kDouble))
                           .clone();
  const at::Tensor n = at::from_blob(count.data(), {static_cast<int64_t>(count.size())},
                                     at::TensorOptions().dtype(at::kDouble))
                           .clone();
  constexpr int64_t kStartBin = 128;
  double best = range, best_err = INFINITY;
  // Candidates in chunks (a [candidates, bins] matrix of float64 per chunk).
  constexpr int64_t kChunk = 256;
  for (int64_t k0 = kStartBin; k0 <= kHistogramBins; k0 += kChunk) {
    const int64_t k1 = std::min<int64_t>(k0 + kChunk, kHistogramBins + 1);
    const at::Tensor amax = at::arange(k0, k1, at::TensorOptions().dtype(at::kDouble)) * width;
    const at::Tensor s = (amax / static_cast<double>(kQuantMax)).unsqueeze(1);
    // |x| >= 0: the positive side of the range saturates at 127.
    const at::Tensor q = at::round(c.unsqueeze(0) / s).clamp(0, kQuantMax) * s;
    const at::Tensor err = ((q - c.unsqueeze(0)).square() * n.unsqueeze(0)).sum(1) / total;
    const int64_t arg = err.argmin().item<int64_t>();
    const double e = err[arg].item<double>();
    if (e < best_err) {
      best_err = e;
      best = amax[arg].item<double>();
    }
  }
  return best;
}

at::Tensor QuantConv2dImpl::forward(const at::Tensor& x) {
  if (!quantized()) return torch::nn::Conv2dImpl::forward(x);
  return _conv_forward(input_quantizer->forward(x), effective_weight());
}

at::Tensor QuantConv2dImpl::effective_weight() {
  return quantized() ? weight_quantizer->forward(weight) : weight;
}

void QuantConv2dImpl::add_quantizers(bool learn_scales) {
  PARALLAX_CHECK(!quantized(), Error, "QuantConv2d: quantizers added twice");
  input_quantizer = register_module("input_quantizer", TensorQuantizer(0, learn_scales));
  weight_quantizer =
      register_module("weight_quantizer", TensorQuantizer(weight.size(0), learn_scales));
  // Built without storage: the transform gives the amax its recipe, the weight's
  // (train/qat/hooks.cpp).
  if (units::deferred_init() == nullptr) {
    at::NoGradGuard no_grad;
    weight_quantizer->amax.copy_(weight_amax(weight).to(weight_quantizer->amax.device()));
  }
  // Data-independent: the weight's amax is known now; what QAT enables, it enables quantizing.
}

}  // namespace parallax::models

namespace parallax::models {

void QuantConv2dImpl::set_initial_weight(at::Tensor w) {
  PARALLAX_CHECK(w.sizes() == weight.sizes() && !quantized(), Error,
                 "QuantConv2d: set_initial_weight with a tensor of shape {} for a weight of {}{}",
                 fmt::format("{}", w.sizes()), fmt::format("{}", weight.sizes()),
                 quantized() ? " after quantizers were added" : "");
  w.set_requires_grad(true);
  parameters_["weight"] = w;
  weight = w;
}

}  // namespace parallax::models
