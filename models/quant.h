// Fake quantization for quantization-aware training (train/qat/qat.h, docs/trainers.md "QAT"): the
// TensorQuantizer module, the quantizable convolution (QuantConv2d), and the calibrators that
// turn collected statistics into an amax.
//
// Arithmetic (symmetric INT8, exactly ONNX QuantizeLinear -> DequantizeLinear with an int8 zero
// point of 0, so that the exported Q/DQ graph computes the same function): scale = amax / 127 (in
// float32), q = clamp(nearbyint(x / scale), -128, 127) (a true float32 division, rounding half to
// even), y = q * scale (fake_quantize() below; the reference in tests/train/qat_test.cpp computes
// the same). Not ATen's fake_quantize_per_*_affine: they multiply by a float reciprocal, which
// rounds some x to the other side of a rounding boundary than ONNX Runtime does. The backward is
// the straight-through estimator clipped to the range: the gradient passes where
// -128 <= q <= 127 before clamping, and is zero elsewhere. Activations (a layer's input) use one
// amax per tensor; weights one per output channel (axis 0).
//
// A quantizer is disabled (pass-through), calibrating (pass-through while collecting the
// statistics its calibrator needs) or quantizing (frozen amax). Its amax is the buffer "amax"
// (float32; [1] per tensor, [C] per channel), so checkpoints hold it beside the weights.
//
// Layers hold quantizers only once QAT adds them (add_quantizers()): the module paths and
// parameter names of a model do not change, and a model without QAT has no extra buffers.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>

namespace parallax::models {

// The INT8 range of ONNX QuantizeLinear (saturation) and the levels of the symmetric scale.
inline constexpr int64_t kQuantMin = -128;
inline constexpr int64_t kQuantMax = 127;
// Bins of the |x| histogram the percentile and MSE calibrators read (pytorch-quantization's
// HistogramCalibrator default).
inline constexpr int64_t kHistogramBins = 2048;
// The smallest amax a quantizer uses (an all-zero channel calibrates to 0; scale 0 would make the
// reciprocal infinite and 0 * inf a NaN): every |x| below it quantizes to 0.
inline constexpr double kMinAmax = 1e-12;

enum class QuantState { kDisabled, kCalibrating, kQuantizing };

// What a calibrating quantizer collects. Pass 1 (kMax): the running max of |x| (per tensor, or per
// output channel). Pass 2 (kHistogram): counts of |x| in kHistogramBins equal bins over
// [0, range], range the max of pass 1 (the data-parallel max under DDP, so that histograms of
// different ranks add bin by bin).
enum class CalibPass { kMax, kHistogram };

class TensorQuantizerImpl : public torch::nn::Module {
 public:
  // channels 0: one amax per tensor; > 0: one per slice of axis 0 (weights [out, ...]).
  // learn_scales (qat.learn_scales, LSQ): "amax" is a parameter, not a buffer, and a quantizing
  // forward gives it the LSQ gradient (fake_quantize()); the optimizer trains it with the weights.
  explicit TensorQuantizerImpl(int64_t channels = 0, bool learn_scales = false);

  // disabled / calibrating: x unchanged (calibrating also collects); quantizing: fake-quantized
  // (in float32, returned in x's dtype).
  at::Tensor forward(const at::Tensor& x);

  QuantState state() const { return state_; }
  void set_state(QuantState s) { state_ = s; }
  bool per_channel() const { return channels_ > 0; }
  int64_t channels() const { return channels_; }

  // Starts a calibration pass (state becomes kCalibrating). kHistogram needs `range` > 0.
  void begin_pass(CalibPass pass, double range = 0);
  // What the passes collected: the max of |x| ([] or [C], float32; undefined before any input)
  // and the histogram (float64 [kHistogramBins], undefined before any input of pass 2).
  at::Tensor& calib_max() { return calib_max_; }
  at::Tensor& histogram() { return hist_; }
  double histogram_range() const { return hist_range_; }
  // Sets amax (copied into the buffer, on its device) and freezes: state kQuantizing; drops the
  // statistics.
  void freeze(const at::Tensor& amax_value);

  // The scale the forward uses: max(amax, kMinAmax) / 127 (float32, the shape of amax).
  at::Tensor scale() const;

  // Called by every quantizing forward with the quotient x / scale (float32, x's shape; the level
  // the call takes is its nearbyint clamped to [-128, 127]). For the ONNX export's parity reference
  // (launch/verb_export.cpp: the rounding ties), not for training; null (the default): none.
  using Observer = std::function<void(const at::Tensor& quotient)>;
  void set_observer(Observer observer) { observer_ = std::move(observer); }

  at::Tensor amax;  // buffer "amax" (a parameter when the scale is learned)

 private:
  Observer observer_;
  int64_t channels_;
  QuantState state_ = QuantState::kDisabled;
  CalibPass pass_ = CalibPass::kMax;
  double hist_range_ = 0;
  at::Tensor calib_max_, hist_;
};
TORCH_MODULE(TensorQuantizer);

// clamp(nearbyint(x / scale), -128, 127) * scale for float32 `x` and a float32 `scale`
// broadcastable to it (per tensor: [1]; per channel: [C, 1, ...]), with the clipped
// straight-through gradient for x. What a quantizing TensorQuantizer computes.
// The scale gets a gradient only when it requires one (a learned scale, under grad mode): LSQ's
// (Esser et al., "Learned Step Size Quantization", 2020), d y / d s = clamp(nearbyint(x / s)) -
// x / s inside the range and the saturated level (-128 or 127) outside, times LSQ's gradient
// scale g = 1 / sqrt(n * 127), n the elements of x per scale value, summed over the elements
// that share the scale.
at::Tensor fake_quantize(const at::Tensor& x, const at::Tensor& scale);

// The per-output-channel max of |w| (axis 0), float32 [out]: a weight quantizer's amax.
at::Tensor weight_amax(const at::Tensor& w);

// Calibrators over a histogram of |x| (`hist`: counts in kHistogramBins equal bins over
// [0, range]); each returns an amax in (0, range].
// The upper edge of the first bin where the cumulative share of counts reaches `percentile` / 100:
// at least that share of |x| lies at or below it, and the exact percentile lies in that bin
// (pytorch-quantization's HistogramCalibrator reads the lower edge; the upper one errs on the side
// of clipping less).
double percentile_amax(const at::Tensor& hist, double range, double percentile);
// The candidate (the upper edge of bins 128..kHistogramBins) minimising the mean squared error of
// quantizing the bin centres weighted by their counts, as pytorch-quantization's "mse" method.
double mse_amax(const at::Tensor& hist, double range);

// torch::nn::Conv2d with optional quantizers on its input (per tensor) and weight (per output
// channel). The same module type as far as checkpoints, weights.h5 and the ONNX emitters go (a
// Conv2dImpl: "weight", "bias", options); call forward() through this type (QuantConv2d) for the
// quantizers to run.
class QuantConv2dImpl : public torch::nn::Conv2dImpl {
 public:
  explicit QuantConv2dImpl(const torch::nn::Conv2dOptions& options)
      : torch::nn::Conv2dImpl(options) {}
  at::Tensor forward(const at::Tensor& x);
  // Registers "input_quantizer" and "weight_quantizer" (disabled; weight amax from the current
  // weight; learned scales: TensorQuantizerImpl). parallax::Error when it already has them.
  void add_quantizers(bool learn_scales = false);
  bool quantized() const { return !input_quantizer.is_empty(); }
  // The weight the forward uses: fake-quantized when the weight quantizer is on.
  at::Tensor effective_weight();
  // Replaces the weight LibTorch initialised by `w` (its shape; made by units::init_*, so that
  // shape-only and deferred construction record it), for another initialisation (the ResNet's
  // kaiming-normal fan_out). Construction only: before any quantizer or engine sees the layer.
  void set_initial_weight(at::Tensor w);

  TensorQuantizer input_quantizer{nullptr}, weight_quantizer{nullptr};
};
TORCH_MODULE(QuantConv2d);

}  // namespace parallax::models
