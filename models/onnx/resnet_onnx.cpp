// ONNX emitters of the ResNet trunk and its FPN (models/resnet.h), standard opset-17 ops only:
//   FrozenBatchNorm2d  Mul and Add by the per-channel scale and shift, computed in float32 from the
//                      four tensors (constant-folded by ONNX Runtime and TensorRT, which then fold
//                      the scale into the convolution before): forward()'s float32 arithmetic in
//                      either graph dtype
//   stem               Conv, Mul/Add, Relu, MaxPool (3x3, stride 2, pads 1)
//   Bottleneck         the three Conv + Mul/Add pairs, the downsample pair, Add, Relu
//   FPN                Conv (1x1), Resize (nearest, asymmetric, floor: upsample_nearest2d's source
//                      index floor(dst / 2)), Add, Conv (3x3)
#include "models/onnx/ops.h"
#include "models/resnet.h"

namespace parallax::models {

onnx::Value FrozenBatchNorm2dImpl::emit_onnx(onnx::Emitter& e, const onnx::Value& x) {
  // Not read by the forward: torchvision's counter, kept for the state_dict's names.
  e.not_exported("num_batches_tracked", "frozen batch norm counter (state_dict compatibility)");
  const at::ScalarType f32 = at::kFloat;
  const auto f = [&](const char* leaf) {
    const onnx::Value w = e.weight(leaf);
    return e.dtype() == f32 ? w : e.cast(w, f32);
  };
  const int64_t c = e.tensor("weight").size(0);
  // forward()'s float32 scale and shift (constant-folded), applied in the graph's dtype.
  const onnx::Value eps = e.scalar(eps_, f32);
  const onnx::Value scale = e.div(f("weight"), e.op("Sqrt", {e.add(f("running_var"), eps)}));
  const onnx::Value shift = e.sub(f("bias"), e.mul(f("running_mean"), scale));
  const auto as_x = [&](const onnx::Value& v) {
    return e.reshape(e.dtype() == f32 ? v : e.cast(v, e.dtype()), {c, 1, 1});
  };
  return e.add(e.mul(x, as_x(scale)), as_x(shift));
}

onnx::Value Bottleneck::emit_onnx(onnx::Emitter& e, const onnx::Value& x) {
  const auto conv_bn = [&](const char* conv, QuantConv2d& c, const char* bn, FrozenBatchNorm2d& n,
                           const onnx::Value& in) {
    const onnx::Value y = onnx::conv2d(e, in, conv, *c);
    auto s = e.scope(bn);
    return n->emit_onnx(e, y);
  };
  onnx::Value y = e.relu(conv_bn("conv1", conv1_, "bn1", bn1_, x));
  y = e.relu(conv_bn("conv2", conv2_, "bn2", bn2_, y));
  y = conv_bn("conv3", conv3_, "bn3", bn3_, y);
  onnx::Value identity = x;
  if (has_downsample()) {
    auto s = e.scope("downsample");
    identity = conv_bn("0", ds_conv_, "1", ds_bn_, x);
  }
  // The conv branch's pair first, then the skip's: the order in which the forward quantizes them.
  const std::string block = e.path();
  const onnx::Value qy = e.hooks().add_input(e, block, y);
  const onnx::Value qx = e.hooks().add_input(e, block, identity);
  return e.relu(e.add(qy, qx));
}

onnx::Value ResNetImpl::emit_stem(onnx::Emitter& e, const onnx::Value& images) {
  onnx::Value y = onnx::conv2d(e, images, "conv1", *conv1_);
  {
    auto s = e.scope("bn1");
    y = bn1_->emit_onnx(e, y);
  }
  return e.op("MaxPool", {e.relu(y)},
              {{"kernel_shape", std::vector<int64_t>{3, 3}},
               {"strides", std::vector<int64_t>{2, 2}},
               {"pads", std::vector<int64_t>{1, 1, 1, 1}}});
}

onnx::Value ResNetImpl::emit_layer(onnx::Emitter& e, int64_t s, const onnx::Value& x) {
  PARALLAX_CHECK(s >= 1 && s <= 4, Error, "ResNet: no stage {} (1..4)", s);
  auto scope = e.scope("layer" + std::to_string(s));
  onnx::Value y = x;
  const auto& stage = stages_[static_cast<std::size_t>(s - 1)];
  for (std::size_t b = 0; b < stage.size(); ++b) {
    auto sb = e.scope(std::to_string(b));
    y = stage[b]->emit_onnx(e, y);
  }
  return y;
}

onnx::Value ResNetFpnImpl::emit_onnx(onnx::Emitter& e, const onnx::Value& c4,
                                     const onnx::Value& c5) {
  const onnx::Value p5 = onnx::conv2d(e, c5, "lateral_convs.1", *lateral5_);
  const onnx::Value up = e.op("Resize", {p5, {""}, e.floats({1.0f, 1.0f, 2.0f, 2.0f}, {4})},
                              {{"mode", std::string("nearest")},
                               {"coordinate_transformation_mode", std::string("asymmetric")},
                               {"nearest_mode", std::string("floor")}});
  const onnx::Value p4 = e.add(onnx::conv2d(e, c4, "lateral_convs.0", *lateral4_), up);
  return onnx::conv2d(e, p4, "fpn_convs.0", *out_conv_);
}

}  // namespace parallax::models
