#include "models/vit.h"

#include "core/error.h"
#include "kernels/fp8.h"
#include "kernels/layer_norm.h"
#include "kernels/qkv_pack.h"
#include "units/param_init.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/nn/init.h>

#include <cmath>
#include <cstdlib>

namespace parallax::models {

namespace {

at::Tensor maybe_dropout(const at::Tensor& x, double p, bool training) {
  return (p > 0 && training) ? at::dropout(x, p, true) : x;
}

// The dtype of the residual stream: autocast's lower precision when autocast is on for x's
// device, else x's own. Keeping the stream in bf16/fp16 under autocast (as Megatron-Core does
// without fp32_residual_connection) halves the memory traffic of every residual add and
// LayerNorm; eager PyTorch under autocast promotes the stream to fp32 at the first add of an
// fp32 parameter (the position embedding) and pays a cast in and out of every LayerNorm.
at::ScalarType stream_dtype(const at::Tensor& x) {
  const c10::DeviceType d = x.device().type();
  if (at::autocast::is_autocast_enabled(d)) return at::autocast::get_autocast_dtype(d);
  return x.scalar_type();
}

// qkv [B, T, 3 * H * hd] -> q, k, v as strided [B, H, T, hd] views (no copy). Autograd's own
// backward of view -> permute -> unbind is a stack of dq, dk, dv into a contiguous
// [3, B, H, T, hd] buffer and then a second full copy, because the permuted stack is not
// viewable as [B, T, 3 * H * hd]. This backward writes dq, dk and dv straight into their slots
// of one [B, T, 3, H, hd] gradient (kernels::pack_qkv_grad, one vectorized kernel on GPUs): one
// pass over the bytes instead of two.
struct SplitQkv : public torch::autograd::Function<SplitQkv> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& qkv, int64_t heads,
                                                int64_t head_dim) {
    ctx->saved_data["shape"] = qkv.sizes().vec();
    const auto parts =
        qkv.view({qkv.size(0), qkv.size(1), 3, heads, head_dim}).permute({2, 0, 3, 1, 4}).unbind(0);
    return {parts[0], parts[1], parts[2]};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto shape = ctx->saved_data["shape"].toIntVector();
    return {kernels::pack_qkv_grad(grads[0], grads[1], grads[2], shape), at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

// LayerNorm in x's dtype: autocast would run it in fp32 (it is on autocast's fp32 list) and
// return fp32. The statistics are still accumulated in fp32 inside the kernel; only the output
// (and the affine parameters, cast per call) are in x's dtype.
at::Tensor layer_norm_in_dtype(torch::nn::LayerNorm& ln, const at::Tensor& x, bool fused) {
  return kernels::add_layer_norm(x, {}, ln->weight, ln->bias, ln->options.eps(), fused).first;
}

at::Tensor normalize_images(const at::Tensor& images, at::ScalarType dtype) {
  if (images.scalar_type() != at::kByte) return images.to(dtype);
  // ImageNet statistics: (x / 255 - mean) / std per channel (dim 1), in float32, with scalar
  // operands only (no host-to-device copy of constants, so no stream synchronisation).
  static constexpr double kMean[3] = {0.485, 0.456, 0.406};
  static constexpr double kStd[3] = {0.229, 0.224, 0.225};
  at::Tensor x = images.to(at::kFloat);
  for (int64_t c = 0; c < 3; ++c)
    x.select(1, c).mul_(1.0 / (255.0 * kStd[c])).sub_(kMean[c] / kStd[c]);
  return x.to(dtype);
}

// ---- attention, MLP, block --------------------------------------------------------------------

AttentionImpl::AttentionImpl(const TransformerBlockOptions& o)
    : head_dim_(o.dim / o.heads), tokens_(o.tokens), dropout_(o.dropout) {
  PARALLAX_CHECK(o.dim % o.heads == 0, ConfigError,
                 "attention: dim {} is not divisible by heads {}", o.dim, o.heads);
  if (o.tp) {
    PARALLAX_CHECK(
        o.heads % o.tp->size() == 0, ConfigError,
        "key 'parallel.tp': {} does not divide the model's {} attention heads (each tp rank "
        "computes whole heads)",
        o.tp->size(), o.heads);
    // Sequence parallel: a padded shard of fewer rows than tp could not tell B from the rows.
    PARALLAX_CHECK(!o.tp->sequence_parallel() || o.tokens >= o.tp->size(), ConfigError,
                   "key 'parallel.sequence_parallel': {} tokens per sample are fewer than tp {}",
                   o.tokens, o.tp->size());
  }
  qkv_ = o.linear({o.dim, 3 * o.dim, o.qkv_bias, LinearRole::kColumn, "qkv", 3});
  proj_ = o.linear({o.dim, o.dim, true, LinearRole::kRow, "proj"});
  register_module("qkv", qkv_.ptr());
  register_module("proj", proj_.ptr());
}

at::Tensor AttentionImpl::forward(const at::Tensor& x) {
  at::Tensor qkv = qkv_.forward<at::Tensor>(x);
  // Sequence parallel: x is this rank's row shard and the column-parallel qkv returned all Rp
  // rows of the flattened tokens, padded to a multiple of tp (fewer than tp <= T pad rows), so
  // B = Rp / T rounded down; the pad rows are dropped here and restored by proj's reduce-scatter.
  const bool rows = x.dim() == 2;
  const int64_t t = rows ? tokens_ : x.size(1);
  const int64_t b = rows ? qkv.size(0) / t : x.size(0);
  if (rows) qkv = qkv.narrow(0, 0, b * t).view({b, t, qkv.size(1)});
  // Heads from the actual width so that a column-parallel qkv (a shard of the heads) just works.
  const int64_t heads = qkv.size(-1) / (3 * head_dim_);
  // [B, T, 3, H, hd] -> 3 x [B, H, T, hd]: strided views, the last dim stays contiguous for SDPA.
  const auto qkv_views = SplitQkv::apply(qkv, heads, head_dim_);
  at::Tensor o;
  const auto on = [](const TensorQuantizer& q) { return q->state() != QuantState::kDisabled; };
  if (quantized() && (on(q_quantizer) || on(k_quantizer) || on(v_quantizer) || on(p_quantizer))) {
    // QAT: the attention as the Q/DQ graph computes it (see the class comment).
    const at::Tensor q = q_quantizer->forward(qkv_views[0]);
    const at::Tensor k = k_quantizer->forward(qkv_views[1]);
    const at::Tensor v = v_quantizer->forward(qkv_views[2]);
    const at::Tensor s =
        at::matmul(q, k.transpose(-2, -1)).mul(1.0 / std::sqrt(static_cast<double>(head_dim_)));
    const at::Tensor p = at::softmax(s, -1, at::kFloat);
    o = at::matmul(p_quantizer->forward(p).to(v.scalar_type()), v);
  } else {
    o = at::scaled_dot_product_attention(qkv_views[0], qkv_views[1], qkv_views[2]);
  }
  o = o.transpose(1, 2).reshape({b, t, heads * head_dim_});
  if (rows) o = o.view({b * t, heads * head_dim_});
  return maybe_dropout(proj_.forward<at::Tensor>(o), dropout_, is_training());
}

void AttentionImpl::add_quantizers(bool learn_scales) {
  PARALLAX_CHECK(!quantized(), Error, "QAT: this attention already has quantizers");
  q_quantizer = register_module("q_quantizer", TensorQuantizer(0, learn_scales));
  k_quantizer = register_module("k_quantizer", TensorQuantizer(0, learn_scales));
  v_quantizer = register_module("v_quantizer", TensorQuantizer(0, learn_scales));
  p_quantizer = register_module("p_quantizer", TensorQuantizer(0, learn_scales));
}

MlpBlockImpl::MlpBlockImpl(const TransformerBlockOptions& o) : dropout_(o.dropout) {
  fc1_ = o.linear({o.dim, o.mlp_hidden, true, LinearRole::kColumn, "fc1"});
  fc2_ = o.linear({o.mlp_hidden, o.dim, true, LinearRole::kRow, "fc2"});
  register_module("fc1", fc1_.ptr());
  register_module("fc2", fc2_.ptr());
}

namespace {
// PARALLAX_FP8_NO_GELU_FOLD set: the GELU and fc2's cast stay two kernels (benchmarks' A/B of
// bench/NOTES.md lever 39, and the test that the fold changes no bit).
const bool kNoGeluFold = std::getenv("PARALLAX_FP8_NO_GELU_FOLD") != nullptr;
}  // namespace

at::Tensor MlpBlockImpl::forward(const at::Tensor& x) {
  const at::Tensor pre = fc1_.forward<at::Tensor>(x);
  auto* fp8_in = kernels::fp8::fp8_child(*fc1_.ptr());
  auto* fp8_out = kernels::fp8::fp8_child(*fc2_.ptr());
  // Under the delayed recipe a dense FP8 fc2 casts gelu(pre) itself: the GELU's output is never
  // written (the same bits; kernels/fp8.h, Fp8LinearImpl::forward_gelu). Not with dropout between
  // the two layers, nor for a row-parallel fc2 (tensor parallelism).
  auto* dense_fc2 = dynamic_cast<DenseLinearImpl*>(fc2_.ptr().get());
  if (fp8_out != nullptr && dense_fc2 != nullptr && fp8_out->folds_gelu() &&
      (dropout_ == 0 || !is_training()) && !kNoGeluFold) {
    return fp8_out->forward_gelu(pre, dense_fc2->weight, dense_fc2->bias, fp8_in);
  }
  // Between FP8 layers the GELU hands each layer the amax it would otherwise read the tensor for.
  at::Tensor h = fp8_in != nullptr || fp8_out != nullptr ? kernels::fp8::gelu(pre, fp8_in, fp8_out)
                                                         : at::gelu(pre);
  h = maybe_dropout(h, dropout_, is_training());
  return maybe_dropout(fc2_.forward<at::Tensor>(h), dropout_, is_training());
}

LayerScaleImpl::LayerScaleImpl(int64_t dim, double init) {
  gamma = register_parameter("gamma", units::init_tensor({dim}, [dim, init] {
                               return at::full({dim}, init, at::TensorOptions().dtype(at::kFloat));
                             }));
}

TransformerBlock::TransformerBlock(const TransformerBlockOptions& o) : opts_(o) {
  norm1_ = register_module("norm1",
                           torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim}).eps(1e-6)));
  attn_ = register_module("attn", Attention(o));
  if (o.layer_scale != 0) ls1_ = register_module("ls1", LayerScale(o.dim, o.layer_scale));
  norm2_ = register_module("norm2",
                           torch::nn::LayerNorm(torch::nn::LayerNormOptions({o.dim}).eps(1e-6)));
  mlp_ = register_module("mlp", MlpBlock(o));
  if (o.layer_scale != 0) ls2_ = register_module("ls2", LayerScale(o.dim, o.layer_scale));
  if (o.tp) {
    // Under sequence parallelism these run on this rank's tokens only: partial gradients.
    for (auto* ln : {&norm1_, &norm2_}) {
      o.tp->mark_sequence_parallel((*ln)->weight);
      o.tp->mark_sequence_parallel((*ln)->bias);
    }
    for (auto* ls : {&ls1_, &ls2_}) {
      if (!ls->is_empty()) o.tp->mark_sequence_parallel((*ls)->gamma);
    }
  }
}

at::Tensor TransformerBlock::forward_impl(const at::Tensor& x) {
  const bool fused = opts_.fused_kernels;
  at::Tensor a = attn_->forward(layer_norm_in_dtype(norm1_, x, fused));
  if (!ls1_.is_empty()) a = ls1_->forward(a);
  // y = x + a and LayerNorm(y) in one kernel (and one backward that also adds y's other gradient);
  // add_layer_norm falls back to the ATen ops itself when the kernel cannot take the inputs.
  const auto [h, y] =
      kernels::add_layer_norm(x, a, norm2_->weight, norm2_->bias, norm2_->options.eps(), fused);
  const at::Tensor m = mlp_->forward(h);
  return y + (ls2_.is_empty() ? m : ls2_->forward(m));
}

Cost TransformerBlock::analytic_cost(const TransformerBlockOptions& o) {
  const double t = static_cast<double>(o.tokens);
  Cost c{4 * o.dim, 0.0};  // two LayerNorms
  if (o.layer_scale != 0) c.params += 2 * o.dim;
  c += linear_cost(o.dim, 3 * o.dim, o.qkv_bias, t);
  c += linear_cost(o.dim, o.dim, true, t);
  c += linear_cost(o.dim, o.mlp_hidden, true, t);
  c += linear_cost(o.mlp_hidden, o.dim, true, t);
  c.flops += 2.0 * 2.0 * t * t * static_cast<double>(o.dim);  // QK^T and AV over all heads
  return c;
}

// ---- ViT --------------------------------------------------------------------------------------

namespace {

int64_t prefix_of(const VisionTransformerOptions& o) {
  return (o.class_token || o.spec.class_token ? 1 : 0) + o.spec.reg_tokens;
}

TransformerBlockOptions block_options(const VisionTransformerOptions& o) {
  const int64_t tokens = VisionTransformerImpl::grid_of(o.image_h, o.spec) *
                             VisionTransformerImpl::grid_of(o.image_w, o.spec) +
                         prefix_of(o);
  TransformerBlockOptions b{
      o.spec.dim, o.spec.heads, o.spec.mlp_hidden,    o.spec.qkv_bias,    o.spec.dropout,
      tokens,     o.linear,     o.spec.fused_kernels, o.spec.layer_scale, o.tp};
  return b;
}

void check_vit(const VisionTransformerOptions& o) {
  PARALLAX_CHECK(
      o.spec.pad_to_patch || (o.image_h % o.spec.patch == 0 && o.image_w % o.spec.patch == 0),
      ConfigError, "ViT: image size {}x{} is not divisible by the patch size {}", o.image_h,
      o.image_w, o.spec.patch);
  PARALLAX_CHECK(o.spec.reg_tokens >= 0, ConfigError, "ViT: {} register tokens", o.spec.reg_tokens);
  PARALLAX_CHECK(o.spec.dim % o.spec.heads == 0, ConfigError,
                 "ViT: dim {} is not divisible by heads {}", o.spec.dim, o.spec.heads);
}

}  // namespace

VisionTransformerImpl::VisionTransformerImpl(const VisionTransformerOptions& o) : opts_(o) {
  check_vit(o);
  const VitSpec& s = o.spec;
  patch_embed_ = register_module(
      "patch_embed",
      units::layer<QuantConv2d>(torch::nn::Conv2dOptions(3, s.dim, s.patch).stride(s.patch)));
  const int64_t pos_tokens = grid_h() * grid_w() + (s.no_embed_class ? 0 : prefix_tokens());
  if (has_class_token())
    cls_token_ = register_parameter("cls_token", units::init_normal({1, 1, s.dim}, 0.02));
  if (s.reg_tokens > 0)
    reg_token_ =
        register_parameter("reg_token", units::init_normal({1, s.reg_tokens, s.dim}, 0.02));
  pos_embed_ = register_parameter("pos_embed", units::init_normal({1, pos_tokens, s.dim}, 0.02));
  const TransformerBlockOptions bo = block_options(o);
  for (int64_t i = 0; i < s.depth; ++i) {
    blocks_.push_back(
        register_module("block" + std::to_string(i), std::make_shared<TransformerBlock>(bo)));
  }
  norm_ =
      register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.dim}).eps(1e-6)));
  if (o.tp) {
    o.tp->mark_sequence_parallel(norm_->weight);
    o.tp->mark_sequence_parallel(norm_->bias);
  }
}

at::Tensor VisionTransformerImpl::forward(const at::Tensor& images) {
  at::Tensor x = embed(images);
  for (const auto& blk : blocks_) x = blk->forward(x);
  return final_norm(x);
}

at::Tensor VisionTransformerImpl::embed(const at::Tensor& images) {
  // The stride-p, kernel-p patch convolution as one GEMM: the non-overlapping patches become rows
  // ([B, gh, gw, C, p, p] -> [B*T, C*p*p], one copy) times the conv weight viewed [D, C*p*p].
  // Same sums as the convolution, without cuDNN's NCHW/NHWC conversions and implicit-GEMM
  // kernels (1.6 ms of kernels per W1 step on an H200; about 1 ms saved, bench/NOTES.md lever 9).
  // The token stream comes out contiguous, so every later linear takes at::linear's fused-bias
  // path.
  const int64_t b = images.size(0), c = images.size(1), p = opts_.spec.patch;
  const int64_t channels = patch_embed_->weight.size(1);
  PARALLAX_CHECK(images.dim() == 4 && c == channels && images.size(2) == opts_.image_h &&
                     images.size(3) == opts_.image_w,
                 Error, "ViT: expected images [B, {}, {}, {}], got {}", channels, opts_.image_h,
                 opts_.image_w, fmt::format("{}", images.sizes()));
  // Under QAT the images are the convolution's input: quantized per tensor before they become rows
  // (elementwise, so the rows hold the same values either way; in the images' layout, the one the
  // exported graph's QuantizeLinear sees), and the weight per output channel, as the conv's would.
  at::Tensor src =
      patch_embed_->quantized() ? patch_embed_->input_quantizer->forward(images) : images;
  // pad_to_patch: zeros at the bottom and right up to whole patches (timm's dynamic_img_pad).
  const int64_t pad_h = grid_h() * p - opts_.image_h, pad_w = grid_w() * p - opts_.image_w;
  if (pad_h > 0 || pad_w > 0) src = at::constant_pad_nd(src, {0, pad_w, 0, pad_h}, 0);
  const at::Tensor rows = src.reshape({b, c, grid_h(), p, grid_w(), p})
                              .permute({0, 2, 4, 1, 3, 5})
                              .reshape({-1, c * p * p});
  const at::Tensor w = patch_embed_->effective_weight();
  at::Tensor x = at::linear(rows, w.view({w.size(0), -1}), patch_embed_->bias)
                     .view({b, grid_h() * grid_w(), -1});
  const at::ScalarType dt = opts_.spec.fp32_residual ? at::kFloat : stream_dtype(x);
  x = x.to(dt);
  // The prefix tokens in timm's order (class, registers), before the position embedding is added
  // when it covers them, after when it does not (no_embed_class).
  std::vector<at::Tensor> parts;
  if (has_class_token()) parts.push_back(cls_token_.to(dt).expand({x.size(0), -1, -1}));
  if (reg_token_.defined()) parts.push_back(reg_token_.to(dt).expand({x.size(0), -1, -1}));
  if (opts_.spec.no_embed_class) x = x + pos_embed_.to(dt);
  if (!parts.empty()) {
    parts.push_back(x);
    x = at::cat(parts, 1);
  }
  if (!opts_.spec.no_embed_class) x = x + pos_embed_.to(dt);
  // Sequence parallel: the blocks take this rank's rows of the tokens.
  if (opts_.tp && opts_.tp->sequence_parallel()) return opts_.tp->scatter_to_sequence(x);
  return x;
}

at::Tensor VisionTransformerImpl::final_norm(const at::Tensor& x) {
  at::Tensor y = layer_norm_in_dtype(norm_, x, opts_.spec.fused_kernels);
  if (x.dim() != 2) return y;
  // Sequence parallel: the consumer (neck, head) is replicated, so every rank gets all tokens
  // (B = padded rows / T rounded down, as in AttentionImpl::forward).
  const int64_t t = grid_h() * grid_w() + prefix_tokens();
  const int64_t b = y.size(0) * opts_.tp->size() / t;
  return opts_.tp->gather_from_sequence(y, b * t).view({b, t, y.size(1)});
}

Cost VisionTransformerImpl::analytic_cost(const VisionTransformerOptions& o) {
  check_vit(o);
  const VitSpec& s = o.spec;
  const TransformerBlockOptions bo = block_options(o);
  Cost c = conv_cost(3, s.dim, s.patch, true, grid_of(o.image_h, s), grid_of(o.image_w, s));
  const int64_t prefix = prefix_of(o);
  c.params += (bo.tokens - (s.no_embed_class ? prefix : 0)) * s.dim + prefix * s.dim;
  c += TransformerBlock::analytic_cost(bo).copies(s.depth);
  c.params += 2 * s.dim;  // final LayerNorm
  return c;
}

// ---- vit_cls ----------------------------------------------------------------------------------

VitClassifier::VitClassifier(const VitSpec& spec, int64_t image_size, int64_t num_classes,
                             LinearFactory linear, units::TpLayersPtr tp)
    : spec_(spec), image_size_(image_size), num_classes_(num_classes) {
  vit_ = register_module("vit", VisionTransformer(VisionTransformerOptions{
                                    spec, image_size, image_size, true, linear, tp}));
  if (tp) {
    PARALLAX_CHECK(num_classes % tp->size() == 0, ConfigError,
                   "key 'parallel.tp': {} does not divide model.num_classes {} (vit_cls's head is "
                   "column-parallel)",
                   tp->size(), num_classes);
    LinearSpec head{spec.dim, num_classes, true, LinearRole::kColumn, "head"};
    head.gather_output = true;
    head.in_sequence_region = false;  // after final_norm() gathered the tokens
    head_ = tp->linear_factory()(head);
  } else {
    head_ = torch::nn::AnyModule(DenseLinear(spec.dim, num_classes));
  }
  register_module("head", head_.ptr());
}

core::TensorDict VitClassifier::forward(const core::TensorDict& batch) {
  return forward_chain(batch);
}

std::vector<at::Tensor> VitClassifier::chain_begin(const core::TensorDict& batch) {
  const at::Tensor& images = batch.at("images");
  PARALLAX_CHECK(images.dim() == 4 && images.size(1) == 3 && images.size(2) == image_size_ &&
                     images.size(3) == image_size_,
                 Error, "vit_cls: batch 'images' must be [B, 3, {}, {}], got {}", image_size_,
                 image_size_, fmt::format("{}", images.sizes()));
  return {images};
}

// The units of units(), in order: the embedding, each block, the final norm with the head.
std::vector<at::Tensor> VitClassifier::chain_unit(int unit, const core::TensorDict&,
                                                  const std::vector<at::Tensor>& in) {
  const int nb = static_cast<int>(vit_->blocks().size());
  if (unit == 0) return {vit_->embed(normalize_images(in.at(0), vit_->param_dtype()))};
  if (unit <= nb) return {vit_->blocks()[static_cast<std::size_t>(unit - 1)]->forward(in.at(0))};
  PARALLAX_CHECK(unit == nb + 1, Error, "vit_cls: no unit {} (it has {})", unit, nb + 2);
  return {head_.forward<at::Tensor>(vit_->final_norm(in.at(0)).select(1, 0))};
}

core::TensorDict VitClassifier::chain_end(const core::TensorDict&,
                                          const std::vector<at::Tensor>& out) {
  return {{"logits", out.at(0)}};
}

std::vector<Unit> VitClassifier::units() const {
  std::vector<UnitPaths> specs{
      {"vit.embed", {"vit.patch_embed", "vit.cls_token", "vit.reg_token", "vit.pos_embed"}}};
  for (std::size_t i = 0; i < vit_->blocks().size(); ++i) {
    const std::string path = "vit.block" + std::to_string(i);
    specs.push_back({path, {path}});
  }
  specs.push_back({"head", {"vit.norm", "head"}});
  return resolve_units(*this, specs);
}

LossOutput VitClassifier::loss(const core::TensorDict& batch, const core::TensorDict& pred) {
  const at::Tensor logits = pred.at("logits").to(at::kFloat);
  const at::Tensor& labels = batch.at("labels");
  at::Tensor ce = at::cross_entropy_loss(logits, labels);
  at::Tensor acc = (logits.argmax(1) == labels).to(at::kFloat).mean();
  return {ce, {{"ce", ce.detach()}, {"accuracy", acc}}};
}

std::vector<std::shared_ptr<torch::nn::Module>> VitClassifier::recomputable_blocks() {
  return {vit_->blocks().begin(), vit_->blocks().end()};
}

core::TensorDict VitClassifier::postprocess(const core::TensorDict& pred) {
  core::TensorDict out = pred;
  out["pred_labels"] = pred.at("logits").argmax(1);
  return out;
}

core::TensorDict VitClassifier::example_batch(int64_t n) const {
  return {{"images", at::randint(0, 256, {n, 3, image_size_, image_size_}, at::kByte)},
          {"labels", at::randint(0, num_classes_, {n}, at::kLong)}};
}

std::vector<ModuleCost> VitClassifier::cost_breakdown() const {
  const Cost vit =
      VisionTransformerImpl::analytic_cost({spec_, image_size_, image_size_, true, dense_linear});
  const Cost head = linear_cost(spec_.dim, num_classes_, true, 1);
  return {{"vit", vit.params, vit.flops}, {"head", head.params, head.flops}};
}

Cost VitClassifier::analytic_cost(const VitSpec& spec, int64_t image_size, int64_t num_classes) {
  return VisionTransformerImpl::analytic_cost({spec, image_size, image_size, true, dense_linear}) +
         linear_cost(spec.dim, num_classes, true, 1);
}

namespace {

struct NamedVit {
  const char* name;
  VitSpec spec;
};

std::vector<NamedVit> named_vits() {
  const auto vit = [](int64_t dim, int64_t depth, int64_t heads, int64_t patch) {
    VitSpec s;
    s.dim = dim;
    s.depth = depth;
    s.heads = heads;
    s.mlp_hidden = 4 * dim;
    s.patch = patch;
    s.class_token = true;
    return s;
  };
  // DINOv2: LayerScale initialised to 1e-5; with registers, 4 of them outside the position
  // embedding (timm's vit_*_patch14_dinov2 and vit_*_patch14_reg4_dinov2).
  const auto dinov2 = [&](int64_t dim, int64_t depth, int64_t heads, bool registers) {
    VitSpec s = vit(dim, depth, heads, 14);
    s.layer_scale = 1e-5;
    if (registers) {
      s.reg_tokens = 4;
      s.no_embed_class = true;
    }
    return s;
  };
  return {{"vit_small_patch16", vit(384, 12, 6, 16)},
          {"vit_base_patch16", vit(768, 12, 12, 16)},
          {"vit_large_patch16", vit(1024, 24, 16, 16)},
          {"vit_small_patch14_dinov2", dinov2(384, 12, 6, false)},
          {"vit_base_patch14_dinov2", dinov2(768, 12, 12, false)},
          {"vit_large_patch14_dinov2", dinov2(1024, 24, 16, false)},
          {"vit_small_patch14_reg4_dinov2", dinov2(384, 12, 6, true)},
          {"vit_base_patch14_reg4_dinov2", dinov2(768, 12, 12, true)},
          {"vit_large_patch14_reg4_dinov2", dinov2(1024, 24, 16, true)}};
}

}  // namespace

std::optional<VitSpec> named_vit(const std::string& name) {
  for (const NamedVit& v : named_vits()) {
    if (name == v.name) return v.spec;
  }
  return std::nullopt;
}

std::string named_vit_list() {
  std::string out;
  for (const NamedVit& v : named_vits()) out += (out.empty() ? "" : "|") + std::string(v.name);
  return out;
}

int enable_fp8(torch::nn::Module& model, const kernels::fp8::Fp8Options& options) {
  int n = 0;
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (dynamic_cast<AttentionImpl*>(m.get()) == nullptr &&
        dynamic_cast<MlpBlockImpl*>(m.get()) == nullptr)
      continue;
    for (const auto& child : m->named_children()) {
      // DenseLinear or a tensor-parallel layer, whichever the block's factory built.
      auto* linear = dynamic_cast<kernels::fp8::Fp8Capable*>(child.value().get());
      if (linear == nullptr) continue;
      linear->enable_fp8(options);
      ++n;
    }
  }
  return n;
}

}  // namespace parallax::models
