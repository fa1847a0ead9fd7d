#include "models/onnx/ops.h"

#include "core/error.h"
#include "models/layers.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <cmath>

namespace parallax::models::onnx {

namespace {

std::string join_leaf(const std::string& layer, const char* leaf) {
  return layer.empty() ? leaf : layer + "." + leaf;
}

}  // namespace

Value linear(Emitter& e, const Value& x, const std::string& layer, bool bias) {
  const std::string name = e.path(layer);
  const Value in = e.hooks().layer_input(e, name, x);
  const Value w = e.hooks().layer_weight(e, name, e.weight(join_leaf(layer, "weight")));
  Value y = e.matmul(in, e.transpose(w, {1, 0}));
  if (bias) y = e.add(y, e.weight(join_leaf(layer, "bias")));
  return y;
}

Value gemm(Emitter& e, const Value& x, const std::string& layer, bool bias) {
  const std::string name = e.path(layer);
  const Value in = e.hooks().layer_input(e, name, x);
  const Value w = e.hooks().layer_weight(e, name, e.weight(join_leaf(layer, "weight")));
  std::vector<Value> inputs{in, w};
  if (bias) inputs.push_back(e.weight(join_leaf(layer, "bias")));
  return e.op("Gemm", inputs, {{"transB", int64_t{1}}});
}

Value conv2d(Emitter& e, const Value& x, const std::string& layer,
             const torch::nn::Conv2dImpl& conv) {
  const auto& o = conv.options;
  const std::string name = e.path(layer);
  PARALLAX_CHECK(std::holds_alternative<torch::ExpandingArray<2>>(o.padding()) &&
                     std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode()),
                 Error, "ONNX export: conv '{}' uses a padding mode the exporter does not map",
                 name);
  const auto k = *o.kernel_size(), s = *o.stride(), d = *o.dilation();
  const auto p = *std::get<torch::ExpandingArray<2>>(o.padding());
  const Value in = e.hooks().layer_input(e, name, x);
  std::vector<Value> inputs{in,
                            e.hooks().layer_weight(e, name, e.weight(join_leaf(layer, "weight")))};
  if (o.bias()) inputs.push_back(e.weight(join_leaf(layer, "bias")));
  return e.op("Conv", inputs,
              {{"kernel_shape", std::vector<int64_t>{k[0], k[1]}},
               {"strides", std::vector<int64_t>{s[0], s[1]}},
               {"dilations", std::vector<int64_t>{d[0], d[1]}},
               {"pads", std::vector<int64_t>{p[0], p[1], p[0], p[1]}},
               {"group", int64_t{o.groups()}}});
}

Value group_norm(Emitter& e, const Value& x, const std::string& layer,
                 const torch::nn::GroupNormImpl& norm, int64_t h, int64_t w) {
  const int64_t g = norm.options.num_groups(), c = norm.options.num_channels();
  // Statistics in float32 (LibTorch's CPU group_norm accumulates in float32 too; under autocast
  // the whole op runs in float32).
  Value xf = e.dtype() == at::kFloat ? x : e.cast(x, at::kFloat);
  xf = e.reshape(xf, {0, g, -1});
  const Value centred = e.sub(xf, e.reduce_mean(xf, {2}, true));
  const Value var = e.reduce_mean(e.mul(centred, centred), {2}, true);  // biased, as PyTorch
  const Value std = e.op("Sqrt", {e.add(var, e.scalar(norm.options.eps(), at::kFloat))});
  Value y = e.reshape(e.div(centred, std), {0, c, h, w});
  if (e.dtype() != at::kFloat) y = e.cast(y, e.dtype());
  if (norm.options.affine()) {
    const Value gamma = e.reshape(e.weight(join_leaf(layer, "weight")), {c, 1, 1});
    const Value beta = e.reshape(e.weight(join_leaf(layer, "bias")), {c, 1, 1});
    y = e.add(e.mul(y, gamma), beta);
  }
  return y;
}

Value layer_norm(Emitter& e, const Value& x, const std::string& layer,
                 const torch::nn::LayerNormImpl& norm) {
  const auto& shape = norm.options.normalized_shape();
  PARALLAX_CHECK(shape.size() == 1 && norm.options.elementwise_affine(), Error,
                 "ONNX export: LayerNorm '{}' must normalise one dimension with an affine map",
                 e.path(layer));
  return e.op("LayerNormalization",
              {x, e.weight(join_leaf(layer, "weight")), e.weight(join_leaf(layer, "bias"))},
              {{"axis", int64_t{-1}}, {"epsilon", norm.options.eps()}, {"stash_type", int64_t{1}}});
}

Value gelu(Emitter& e, const Value& x) {
  // ATen: x * 0.5 * (1 + erf(x * M_SQRT1_2)).
  const at::ScalarType t = e.dtype();
  const Value erf = e.op("Erf", {e.mul(x, e.scalar(M_SQRT1_2, t))});
  return e.mul(e.mul(x, e.scalar(0.5, t)), e.add(erf, e.scalar(1.0, t)));
}

Value normalize_images(Emitter& e, const Value& images, int64_t channel_axis, int64_t rank) {
  // The constants as models::normalize_images forms them: double arithmetic rounded once to
  // float32, which is what ATen's mul_/sub_ with a double Scalar on a float32 tensor computes with.
  static constexpr double kMean[3] = {0.485, 0.456, 0.406};
  static constexpr double kStd[3] = {0.229, 0.224, 0.225};
  std::vector<float> scale, shift;
  for (int c = 0; c < 3; ++c) {
    scale.push_back(static_cast<float>(1.0 / (255.0 * kStd[c])));
    shift.push_back(static_cast<float>(kMean[c] / kStd[c]));
  }
  std::vector<int64_t> shape(rank, 1);
  shape[channel_axis < 0 ? channel_axis + rank : channel_axis] = 3;
  Value x = e.cast(images, at::kFloat);
  x = e.sub(e.mul(x, e.floats(scale, shape)), e.floats(shift, shape));
  return e.dtype() == at::kFloat ? x : e.cast(x, e.dtype());
}

Value linear_module(Emitter& e, const std::string& layer, torch::nn::Module& m, const Value& x) {
  if (auto* d = dynamic_cast<DenseLinearImpl*>(&m)) return linear(e, x, layer, d->bias.defined());
  if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(&m))
    return linear(e, x, layer, l->options.bias());
  e.no_emitter(layer, m);
}

Value module(Emitter& e, const std::string& leaf, torch::nn::Module& m, const Value& x) {
  if (auto* l = dynamic_cast<torch::nn::LinearImpl*>(&m))
    return linear(e, x, leaf, l->options.bias());
  if (auto* d = dynamic_cast<DenseLinearImpl*>(&m)) return linear(e, x, leaf, d->bias.defined());
  if (auto* g = dynamic_cast<torch::nn::GELUImpl*>(&m)) {
    PARALLAX_CHECK(g->options.approximate() == "none", Error,
                   "ONNX export: layer '{}': GELU approximate='{}' is not mapped (only 'none')",
                   e.path(leaf), g->options.approximate());
    return gelu(e, x);
  }
  if (dynamic_cast<torch::nn::ReLUImpl*>(&m)) return e.relu(x);
  if (auto* s = dynamic_cast<torch::nn::SequentialImpl*>(&m)) {
    auto sc = e.scope(leaf);
    Value y = x;
    for (const auto& child : s->named_children()) y = module(e, child.key(), *child.value(), y);
    return y;
  }
  e.no_emitter(leaf, m);
}

}  // namespace parallax::models::onnx
