// ONNX emitters of the `bev` model (models/perception_model.h): image normalisation, the image
// backbones (the ResNet's layers in models/onnx/resnet_onnx.cpp), the view transformer, the BEV
// encoder and the heads.
//
// The view transformer's sampling follows kernels/bev_sample.h's reference, written with plain ops
// as TensorRT's guidance for BEV models asks (no NonZero, no boolean indexing, no plugins): the
// camera geometry of models/geometry.cpp as elementwise products and sums in float32; every
// reference point sampled in every camera by one 4-D GridSample (bilinear, align_corners=0, zero
// padding), with the points a camera does not see parked outside the map; the mean over the
// cameras that see a point and its seen flag as arithmetic on the visibility mask cast to float.
// LibTorch's CPU path samples only the visible points of each camera (ViewTransformerImpl::sample);
// the result is the same, since a parked point reads zeros and is weighted 0 anyway.
#include "core/error.h"
#include "models/detection.h"
#include "models/geometry.h"
#include "models/onnx/ops.h"
#include "models/perception_model.h"

#include <ATen/ATen.h>

#include <cmath>

namespace parallax::models {

namespace {

// geometry.cpp's small_matmul: a [..., I, K] times b [..., K, J] as a broadcast product summed
// over K (the same float32 operations; no MatMul, whose kernels may fuse multiply-adds).
onnx::Value small_matmul(onnx::Emitter& e, const onnx::Value& a, const onnx::Value& b) {
  return e.reduce_sum(e.mul(e.unsqueeze(a, {-1}), e.unsqueeze(b, {-3})), {-2}, false);
}

}  // namespace

onnx::Value ImageEncoderImpl::emit_unit(onnx::Emitter& e, int64_t index, const onnx::Value& x) {
  if (vit_) {
    const int64_t blocks = static_cast<int64_t>(blocks_.size());
    if (index < blocks + 1) {
      auto s = e.scope("vit");
      return index == 0 ? vit_->emit_embed(e, x) : vit_->emit_block(e, index - 1, x);
    }
    onnx::Value tokens;
    {
      auto s = e.scope("vit");
      tokens = vit_->emit_final_norm(e, x);
    }
    const int64_t prefix = vit_->prefix_tokens();
    if (prefix > 0)  // the class and register tokens are not part of the feature map
      tokens = e.slice(tokens, 1, prefix, prefix + vit_->grid_h() * vit_->grid_w());
    tokens = onnx::linear(e, tokens, "neck", true);  // [BN, T, C]
    // [BN, gh, gw, C] -> [BN, C, gh, gw] (forward()'s channels-last view).
    return e.transpose(e.reshape(tokens, {0, vit_->grid_h(), vit_->grid_w(), opts_.out_channels}),
                       {0, 3, 1, 2});
  }
  if (resnet_) {
    if (index == 3) {  // x: C4; layer4, then the FPN on C4 and C5
      onnx::Value c5;
      {
        auto s = e.scope("resnet");
        c5 = resnet_->emit_layer(e, 4, x);
      }
      auto s = e.scope("fpn");
      return fpn_->emit_onnx(e, x, c5);
    }
    auto s = e.scope("resnet");
    return index == 0 ? resnet_->emit_layer(e, 1, resnet_->emit_stem(e, x))
                      : resnet_->emit_layer(e, index + 1, x);
  }
  onnx::Value y = x;
  {
    auto s = e.scope("conv");
    for (const auto& child : conv_->named_children()) {
      auto sc = e.scope(child.key());
      if (auto* c = dynamic_cast<ConvNormActImpl*>(child.value().get())) {
        y = c->emit_onnx(e, y);
      } else if (auto* b = dynamic_cast<Block*>(child.value().get())) {
        y = b->emit_onnx(e, y);
      } else {
        e.no_emitter("", *child.value());
      }
    }
  }
  return onnx::conv2d(e, y, "neck", *conv_neck_);
}

onnx::Value ViewTransformerImpl::emit_onnx(onnx::Emitter& e, const onnx::Value& features,
                                           const onnx::Value& intrinsics,
                                           const onnx::Value& cam_to_ego, int64_t cameras) {
  const int64_t n = cameras, c = opts_.in_channels, z = static_cast<int64_t>(opts_.heights.size());
  const int64_t nx = opts_.grid.nx, ny = opts_.grid.ny, p = z * opts_.grid.cells();
  const at::ScalarType f32 = at::kFloat;

  // ego_to_image (geometry.cpp): K @ [R^T | -R^T t], [B, N, 3, 4].
  const onnx::Value top = e.slice(cam_to_ego, 2, 0, 3);                     // [B, N, 3, 4]
  const onnx::Value rt = e.transpose(e.slice(top, 3, 0, 3), {0, 1, 3, 2});  // [B, N, 3, 3]
  const onnx::Value t = e.slice(top, 3, 3, 4);                              // [B, N, 3, 1]
  const onnx::Value ego_to_cam = e.concat({rt, e.op("Neg", {small_matmul(e, rt, t)})}, -1);
  const onnx::Value m = small_matmul(e, intrinsics, ego_to_cam);  // [B, N, 3, 4]

  // project_points: uvw [B, N, P, 3] = sum_c M[.., r, c] p[c] + M[.., r, 3].
  const at::Tensor points = reference_points(c10::Device(c10::kCPU)).view({1, 1, p, 1, 3});
  const onnx::Value rot = e.unsqueeze(e.slice(m, 3, 0, 3), {2});             // [B, N, 1, 3, 3]
  const onnx::Value shift = e.transpose(e.slice(m, 3, 3, 4), {0, 1, 3, 2});  // [B, N, 1, 3]
  const onnx::Value uvw = e.add(e.reduce_sum(e.mul(rot, e.constant(points)), {-1}, false), shift);
  const onnx::Value depth = e.slice(uvw, 3, 2, 3);  // [B, N, P, 1]
  const onnx::Value eps = e.scalar(1e-6, f32);
  const onnx::Value safe = e.op("Where", {e.op("Less", {e.op("Abs", {depth}), eps}), eps, depth});
  const onnx::Value uv = e.div(e.slice(uvw, 3, 0, 2), safe);  // [B, N, P, 2]

  // visibility_mask: depth > 0.1 m and (u, v) in [0, W) x [0, H).
  const onnx::Value u = e.slice(uv, 3, 0, 1), v = e.slice(uv, 3, 1, 2);
  const onnx::Value zero = e.scalar(0.0, f32);
  onnx::Value visible = e.op("Greater", {depth, e.scalar(kMinDepth, f32)});
  visible = e.op("And", {visible, e.op("GreaterOrEqual", {u, zero})});
  visible =
      e.op("And", {visible, e.op("Less", {u, e.scalar(static_cast<double>(opts_.image_w), f32)})});
  visible = e.op("And", {visible, e.op("GreaterOrEqual", {v, zero})});
  visible =
      e.op("And", {visible, e.op("Less", {v, e.scalar(static_cast<double>(opts_.image_h), f32)})});

  // bev_sample's reference: normalised coordinates 2u/W - 1 (align_corners=false), unseen points
  // parked at -2, one bilinear sample per camera and point in float32.
  const onnx::Value scale = e.floats({static_cast<float>(2.0 / static_cast<double>(opts_.map_w())),
                                      static_cast<float>(2.0 / static_cast<double>(opts_.map_h()))},
                                     {2});
  onnx::Value grid = e.sub(e.mul(uv, scale), e.scalar(1.0, f32));
  grid = e.op("Where", {visible, grid, e.scalar(-2.0, f32)});
  grid = e.reshape(grid, {-1, 1, p, 2});  // [B*N, 1, P, 2]
  const onnx::Value f = e.dtype() == f32 ? features : e.cast(features, f32);
  onnx::Value s = e.op("GridSample", {f, grid},
                       {{"align_corners", int64_t{0}},
                        {"mode", std::string("bilinear")},
                        {"padding_mode", std::string("zeros")}});  // [B*N, C, 1, P]
  s = e.reshape(s, {-1, n, c, p});                                 // [B, N, C, P]

  // Mean over the cameras that see a point, and its seen flag, from the mask as float32.
  const onnx::Value weight = e.reshape(e.cast(visible, f32), {0, n, 1, p});  // [B, N, 1, P]
  const onnx::Value acc = e.reduce_sum(e.mul(s, weight), {1}, false);        // [B, C, P]
  const onnx::Value count = e.reduce_sum(weight, {1}, false);                // [B, 1, P]
  onnx::Value mean = e.div(acc, e.op("Max", {count, e.scalar(1.0, f32)}));
  onnx::Value seen = e.cast(e.op("Greater", {count, zero}), e.dtype());
  if (e.dtype() != f32) mean = e.cast(mean, e.dtype());
  // [B, C*Z + Z, nx, ny]: channel c*Z + z holds height z of channel c, then the Z seen flags.
  onnx::Value x =
      e.concat({e.reshape(mean, {0, c * z, nx, ny}), e.reshape(seen, {0, z, nx, ny})}, 1);

  x = onnx::conv2d(e, x, "lift1", *lift1_);
  x = e.relu(onnx::group_norm(e, x, "norm", *norm_, nx, ny));
  x = onnx::conv2d(e, x, "lift2", *lift2_);
  return e.add(x, e.weight("query_embed"));
}

std::vector<onnx::Value> BevHeadsImpl::emit_onnx(onnx::Emitter& e, const onnx::Value& bev) {
  auto branch = [&](const char* conv_name, ConvNormAct& conv, const char* out_name,
                    QuantConv2d& out) {
    onnx::Value y;
    {
      auto s = e.scope(conv_name);
      y = conv->emit_onnx(e, bev);
    }
    return onnx::conv2d(e, y, out_name, *out);
  };
  return {branch("seg_conv", seg_conv_, "seg_out", seg_out_),
          branch("heat_conv", heat_conv_, "heat_out", heat_out_),
          branch("reg_conv", reg_conv_, "reg_out", reg_out_)};
}

Model::OnnxFlow PerceptionModel::emit_onnx_inputs(onnx::Emitter& e) {
  // The streaming graph (the previous BEV in, the current one out) is not built yet.
  PARALLAX_CHECK(spec_.frames == 1, ConfigError,
                 "export: ONNX of a temporal bev model (model.temporal.frames = {}) is not "
                 "supported yet; export the weights (--format weights) instead",
                 spec_.frames);
  const auto& sc = spec_.scene;
  const int64_t n = sc.num_cameras, h = sc.image_height, w = sc.image_width;
  const onnx::Value images = e.input("images", at::kByte, {onnx::kBatch, n, h, w, 3});
  const onnx::Value intrinsics = e.input("intrinsics", at::kFloat, {onnx::kBatch, n, 3, 3});
  const onnx::Value cam_to_ego = e.input("cam_to_ego", at::kFloat, {onnx::kBatch, n, 4, 4});
  return {{images}, {{"images", images}, {"intrinsics", intrinsics}, {"cam_to_ego", cam_to_ego}}};
}

// The units of units(), as forward() runs them: the image encoder's (the first one folds the
// cameras into the batch and normalises the images), the view transformer (which reads the camera
// geometry), each BEV encoder block, the heads (with the resampling of the segmentation logits).
std::vector<onnx::Value> PerceptionModel::emit_onnx_unit(onnx::Emitter& e, int unit,
                                                         const OnnxFlow& flow) {
  const auto& sc = spec_.scene;
  const int64_t n = sc.num_cameras, h = sc.image_height, w = sc.image_width;
  const int encoder_units = static_cast<int>(encoder_->num_units());
  const int bev_blocks = static_cast<int>(bev_blocks_.size());
  onnx::Value x = flow.values.at(0);
  if (unit < encoder_units) {
    if (unit == 0) {
      x = e.reshape(x, {-1, h, w, 3});
      x = e.transpose(onnx::normalize_images(e, x, 3, 4), {0, 3, 1, 2});
    }
    auto s = e.scope("encoder");
    return {encoder_->emit_unit(e, unit, x)};
  }
  if (unit == encoder_units) {
    auto s = e.scope("view");
    return {view_->emit_onnx(e, x, flow.inputs.at("intrinsics"), flow.inputs.at("cam_to_ego"), n)};
  }
  if (unit < encoder_units + 1 + bev_blocks) {
    const int i = unit - encoder_units - 1;
    auto s = e.scope("bev_block" + std::to_string(i));
    return {bev_blocks_[static_cast<std::size_t>(i)]->emit_onnx(e, x)};
  }
  std::vector<onnx::Value> out;
  {
    auto s = e.scope("heads");
    out = heads_->emit_onnx(e, x);
  }
  const BevGrid lg = spec_.label_grid(), &g = spec_.query_grid;
  if (g.nx != lg.nx || g.ny != lg.ny) {
    // upsample_bilinear2d(align_corners=false) to the label grid: Resize linear, half_pixel (the
    // same source coordinate (x + 0.5) / scale - 0.5, clamped at the edges). Constant `scales`, not
    // `sizes`: opset 17's sizes cover every axis, and sizes built from Shape(x) for a dynamic batch
    // leave shape inference without the output's shape. Each scale is out/in rounded to float32 and
    // nudged up until in * scale >= out, so floor(in * scale) = out; the source coordinates then
    // differ from ATen's in/out by at most an ulp.
    auto exact_scale = [](int64_t in, int64_t out_size) {
      float s = static_cast<float>(static_cast<double>(out_size) / static_cast<double>(in));
      while (static_cast<float>(in) * s < static_cast<float>(out_size))
        s = std::nextafter(s, 2.0f * s);
      return s;
    };
    const onnx::Value scales =
        e.floats({1.0f, 1.0f, exact_scale(g.nx, lg.nx), exact_scale(g.ny, lg.ny)}, {4});
    out[0] = e.op("Resize", {out[0], {""}, scales},
                  {{"mode", std::string("linear")},
                   {"coordinate_transformation_mode", std::string("half_pixel")}});
  }
  return out;
}

void PerceptionModel::emit_onnx_outputs(onnx::Emitter& e, const OnnxFlow& flow) {
  std::vector<onnx::Value> out = flow.values;
  if (e.dtype() != at::kFloat) {
    for (auto& o : out) o = e.cast(o, at::kFloat);
  }
  const auto& sc = spec_.scene;
  const BevGrid lg = spec_.label_grid(), &g = spec_.query_grid;
  const int64_t seg_classes = static_cast<int64_t>(sc.bev_classes.size());
  const int64_t box_classes = static_cast<int64_t>(sc.box_classes.size());
  e.metadata("parallax.inputs",
             "images: uint8 [B, N, H, W, 3] RGB, normalised inside the graph (ImageNet mean/std); "
             "intrinsics: "
             "float32 [B, N, 3, 3]; cam_to_ego: float32 [B, N, 4, 4] (docs/data.md)");
  e.output("bev_logits", out.at(0), at::kFloat, {onnx::kBatch, seg_classes, lg.nx, lg.ny});
  e.output("heatmap", out.at(1), at::kFloat, {onnx::kBatch, box_classes, g.nx, g.ny});
  e.output("box_reg", out.at(2), at::kFloat,
           {onnx::kBatch, box_code_size(spec_.velocity), g.nx, g.ny});
}

}  // namespace parallax::models
