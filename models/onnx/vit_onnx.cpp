// ONNX emitters of the ViT (models/vit.h): attention as MatMul + Softmax (opset 17 has no
// Attention op), LayerNorm as LayerNormalization, the fused residual add + LayerNorm
// (kernels/layer_norm.h) as its reference Add then LayerNormalization, the patch embedding as the
// Conv it is (kernel = stride = patch; LibTorch computes the same sums as one GEMM).
#include "models/onnx/ops.h"
#include "models/vit.h"

#include <cmath>

namespace parallax::models {

onnx::Value AttentionImpl::emit_onnx(onnx::Emitter& e, const onnx::Value& x) {
  const onnx::Value qkv = onnx::linear_module(e, "qkv", *qkv_.ptr(), x);  // [B, T, 3 * H * hd]
  // Heads from the weight's width, as forward() derives them from the activation's.
  const int64_t heads = e.tensor("qkv.weight").size(0) / (3 * head_dim_);
  // [B, T, 3, H, hd] -> [3, B, H, T, hd] -> q, k, v [B, H, T, hd] (forward()'s SplitQkv views).
  const onnx::Value parts =
      e.transpose(e.reshape(qkv, {0, 0, 3, heads, head_dim_}), {2, 0, 3, 1, 4});
  std::vector<onnx::Value> qkv_parts;
  const std::string attention = e.path();
  for (int64_t i = 0; i < 3; ++i) {
    const onnx::Value part = e.op("Gather", {parts, e.constant(at::scalar_tensor(i, at::kLong))},
                                  {{"axis", int64_t{0}}});
    // QAT (qat.attention): the Q/DQ pairs of q, k, v, in the order the forward quantizes them.
    qkv_parts.push_back(e.hooks().attention_input(e, attention,
                                                  i == 0   ? "q"
                                                  : i == 1 ? "k"
                                                           : "v",
                                                  part));
  }
  // softmax(q k^T / sqrt(hd)) v: SDPA's default scale. The softmax runs in float32 (as autocast
  // runs it; the fused kernels accumulate it in float32).
  onnx::Value scores = e.matmul(qkv_parts[0], e.transpose(qkv_parts[1], {0, 1, 3, 2}));
  scores = e.mul(scores, e.scalar(1.0 / std::sqrt(static_cast<double>(head_dim_)), e.dtype()));
  if (e.dtype() != at::kFloat) scores = e.cast(scores, at::kFloat);
  onnx::Value attn = e.op("Softmax", {scores}, {{"axis", int64_t{-1}}});
  attn = e.hooks().attention_input(e, attention, "p", attn);
  if (e.dtype() != at::kFloat) attn = e.cast(attn, e.dtype());
  onnx::Value o = e.matmul(attn, qkv_parts[2]);                            // [B, H, T, hd]
  o = e.reshape(e.transpose(o, {0, 2, 1, 3}), {0, 0, heads * head_dim_});  // [B, T, H * hd]
  return onnx::linear_module(e, "proj", *proj_.ptr(), o);  // dropout: identity in eval
}

onnx::Value MlpBlockImpl::emit_onnx(onnx::Emitter& e, const onnx::Value& x) {
  const onnx::Value h = onnx::gelu(e, onnx::linear_module(e, "fc1", *fc1_.ptr(), x));
  return onnx::linear_module(e, "fc2", *fc2_.ptr(), h);
}

onnx::Value TransformerBlock::emit_onnx(onnx::Emitter& e, const onnx::Value& x) {
  onnx::Value a;
  {
    const onnx::Value h = onnx::layer_norm(e, x, "norm1", *norm1_);
    auto s = e.scope("attn");
    a = attn_->emit_onnx(e, h);
  }
  // LayerScale: the branch times its per-channel gamma.
  const auto scaled = [&](const char* name, const LayerScale& ls, const onnx::Value& v) {
    if (ls.is_empty()) return v;
    auto s = e.scope(name);
    return e.mul(v, e.weight("gamma"));
  };
  a = scaled("ls1", ls1_, a);
  // kernels::add_layer_norm's reference: y = x + a, h = LayerNorm(y).
  const onnx::Value y = e.add(x, a);
  const onnx::Value h = onnx::layer_norm(e, y, "norm2", *norm2_);
  onnx::Value m;
  {
    auto s = e.scope("mlp");
    m = mlp_->emit_onnx(e, h);
  }
  return e.add(y, scaled("ls2", ls2_, m));
}

onnx::Value VisionTransformerImpl::emit_embed(onnx::Emitter& e, const onnx::Value& images) {
  const int64_t d = opts_.spec.dim, t = grid_h() * grid_w(), p = opts_.spec.patch;
  onnx::Value src = images;
  const int64_t pad_h = grid_h() * p - opts_.image_h, pad_w = grid_w() * p - opts_.image_w;
  if (pad_h > 0 || pad_w > 0)  // pad_to_patch: zeros at the bottom and right (ONNX Pad, NCHW)
    src = e.op("Pad", {src, e.ints({0, 0, 0, 0, 0, 0, pad_h, pad_w})});
  onnx::Value x = onnx::conv2d(e, src, "patch_embed", *patch_embed_);  // [B, D, gh, gw]
  x = e.transpose(e.reshape(x, {0, d, t}), {0, 2, 1});                 // [B, T, D]
  // The prefix tokens expanded to [B, n, D] (B from the tokens' shape) and put first, in
  // embed()'s order; the position embedding added before them with no_embed_class.
  std::vector<onnx::Value> parts;
  const onnx::Value b = e.slice(e.op("Shape", {x}), 0, 0, 1);
  const auto prefix = [&](const char* name, int64_t n) {
    parts.push_back(e.op("Expand", {e.weight(name), e.concat({b, e.ints({n, d})}, 0)}));
  };
  if (has_class_token()) prefix("cls_token", 1);
  if (opts_.spec.reg_tokens > 0) prefix("reg_token", opts_.spec.reg_tokens);
  if (opts_.spec.no_embed_class) x = e.add(x, e.weight("pos_embed"));
  if (!parts.empty()) {
    parts.push_back(x);
    x = e.concat(parts, 1);
  }
  return opts_.spec.no_embed_class ? x : e.add(x, e.weight("pos_embed"));
}

onnx::Value VisionTransformerImpl::emit_block(onnx::Emitter& e, int64_t index,
                                              const onnx::Value& x) {
  auto s = e.scope("block" + std::to_string(index));
  return blocks_.at(static_cast<std::size_t>(index))->emit_onnx(e, x);
}

onnx::Value VisionTransformerImpl::emit_final_norm(onnx::Emitter& e, const onnx::Value& x) {
  return onnx::layer_norm(e, x, "norm", *norm_);
}

onnx::Value VisionTransformerImpl::emit_onnx(onnx::Emitter& e, const onnx::Value& images) {
  onnx::Value x = emit_embed(e, images);
  for (size_t i = 0; i < blocks_.size(); ++i) x = emit_block(e, static_cast<int64_t>(i), x);
  return emit_final_norm(e, x);
}

Model::OnnxFlow VitClassifier::emit_onnx_inputs(onnx::Emitter& e) {
  const int64_t s = image_size_;
  const onnx::Value images = e.input("images", at::kByte, {onnx::kBatch, 3, s, s});
  return {{images}, {{"images", images}}};
}

// The units of units(): "vit.embed" (normalisation inside the graph, then the embedding), each
// "vit.block<i>", "head" (the final LayerNorm, the class token's feature, the linear head).
std::vector<onnx::Value> VitClassifier::emit_onnx_unit(onnx::Emitter& e, int unit,
                                                       const OnnxFlow& flow) {
  const int blocks = static_cast<int>(vit_->blocks().size());
  const onnx::Value& x = flow.values.at(0);
  if (unit == 0) {
    auto sc = e.scope("vit");
    return {vit_->emit_embed(e, onnx::normalize_images(e, x, 1, 4))};
  }
  if (unit <= blocks) {
    auto sc = e.scope("vit");
    return {vit_->emit_block(e, unit - 1, x)};
  }
  onnx::Value tokens;
  {
    auto sc = e.scope("vit");
    tokens = vit_->emit_final_norm(e, x);
  }
  const onnx::Value cls =
      e.op("Gather", {tokens, e.constant(at::scalar_tensor(0, at::kLong))}, {{"axis", int64_t{1}}});
  return {onnx::gemm(e, cls, "head", true)};
}

void VitClassifier::emit_onnx_outputs(onnx::Emitter& e, const OnnxFlow& flow) {
  onnx::Value logits = flow.values.at(0);
  if (e.dtype() != at::kFloat) logits = e.cast(logits, at::kFloat);
  e.metadata("parallax.inputs",
             "images: uint8 [B, 3, H, W] RGB, normalised inside the graph (ImageNet mean/std)");
  e.output("logits", logits, at::kFloat, {onnx::kBatch, num_classes_});
}

}  // namespace parallax::models
