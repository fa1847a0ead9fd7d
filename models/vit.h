// Vision Transformer: patch embedding, pre-norm transformer blocks (multi-head self-attention
// through at::scaled_dot_product_attention, GELU MLP) and a final LayerNorm. Used as the image
// backbone of the perception model (no class token, features reshaped to a map) and as the
// `vit_cls` classifier (class token, head), which matches timm's vit_base_patch16_224 in shapes,
// parameter count and FLOPs.
//
// Layouts: tokens are [B, T, D] (batch first, contiguous). Attention computes q, k, v from one
// fused qkv linear and passes strided views (no copies) to SDPA, which picks flash attention on
// GPU for fp16/bf16.
#pragma once

#include "models/layers.h"
#include "models/model.h"

#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <optional>
#include <string>

namespace parallax::models {

// Shape of a ViT; the defaults are ViT-B/16.
struct VitSpec {
  int64_t dim = 768;
  int64_t depth = 12;
  int64_t heads = 12;
  int64_t mlp_hidden = 3072;
  int64_t patch = 16;
  bool qkv_bias = true;
  double dropout = 0.0;  // after the attention projection and in the MLP
  // Under autocast, keep the residual stream and LayerNorms in fp32 (eager PyTorch's behaviour)
  // instead of autocast's dtype (the default; see vit.cpp).
  bool fp32_residual = false;
  // Residual add + LayerNorm through kernels/ (fused CUDA kernels on GPU; ATen otherwise).
  bool fused_kernels = true;
  // Prefix tokens before the patch tokens, in timm's order [class, registers..., patches]: a class
  // token (`cls_token` [1, 1, D]) and `reg_tokens` register tokens (`reg_token` [1, R, D], as
  // DINOv2 with registers). A backbone drops them from its feature map; they still attend.
  bool class_token = false;
  int64_t reg_tokens = 0;
  // The position embedding covers the patch tokens only, added before the prefix tokens are put in
  // front (timm's no_embed_class: DeiT-3, DINOv2 with registers); else it covers them too.
  bool no_embed_class = false;
  // LayerScale (CaiT, DINOv2): each block scales its attention and MLP outputs per channel by
  // learned `ls1.gamma` and `ls2.gamma` [D], initialised to this value; 0: none.
  double layer_scale = 0.0;
  // An image whose size is not a multiple of the patch is padded with zeros at the bottom and
  // right to the next multiple (timm's dynamic_img_pad), so the grid is ceil(H / p) x ceil(W / p).
  // Off: the size must be a multiple (ConfigError otherwise).
  bool pad_to_patch = false;
  int64_t prefix_tokens() const { return (class_token ? 1 : 0) + reg_tokens; }
};

// The ViT shapes of a named backbone (`model.backbone`), timm's architectures without the input
// resolution: vit_small_patch16, vit_base_patch16, vit_large_patch16 (class token, as timm's
// vit_*_patch16_224), vit_{small,base,large}_patch14_dinov2 (class token, LayerScale 1e-5) and
// vit_{small,base,large}_patch14_reg4_dinov2 (plus 4 register tokens, no_embed_class). nullopt
// for any other name.
std::optional<VitSpec> named_vit(const std::string& name);
// The names named_vit() knows, "a|b|...".
std::string named_vit_list();

struct TransformerBlockOptions {
  int64_t dim = 768, heads = 12, mlp_hidden = 3072;
  bool qkv_bias = true;
  double dropout = 0.0;
  int64_t tokens = 197;  // configured sequence length, for cost() and sequence parallelism
  LinearFactory linear = dense_linear;
  bool fused_kernels = true;  // see VitSpec
  double layer_scale = 0.0;   // see VitSpec
  // Tensor parallelism (null: none): `linear` then builds column/row-parallel layers over it, and
  // with sequence parallelism the token stream between blocks is this rank's row shard
  // (units/tp_layers.h), so the block's LayerNorms are marked sequence-parallel.
  units::TpLayersPtr tp = nullptr;
};

// Multi-head self-attention: qkv (kColumn, 3 fused parts) -> SDPA -> proj (kRow). [B, T, D] ->
// [B, T, D]; under sequence parallelism [R, D] row shards of the flattened tokens -> the same.
//
// QAT (train/qat/qat.h, qat.attention): add_quantizers() registers four per-tensor quantizers on
// the inputs of the two attention matmuls, "q_quantizer", "k_quantizer", "v_quantizer" (the heads'
// q, k, v) and "p_quantizer" (the softmax output), where TensorRT's INT8 attention reads Q/DQ
// pairs. While any of them is not disabled the forward runs the attention as explicit math
// instead of SDPA: s = fq(q) fq(k)^T / sqrt(hd), p = softmax(s) (float32), o = fq(p) fq(v), the
// graph models/onnx/vit_onnx.cpp writes.
class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const TransformerBlockOptions& o);
  at::Tensor forward(const at::Tensor& x);
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& x);  // models/onnx/vit_onnx.cpp

  // parallax::Error when the quantizers exist already. learn_scales: TensorQuantizerImpl.
  void add_quantizers(bool learn_scales = false);
  bool quantized() const { return !q_quantizer.is_empty(); }
  TensorQuantizer q_quantizer{nullptr}, k_quantizer{nullptr}, v_quantizer{nullptr},
      p_quantizer{nullptr};  // empty without qat.attention

 private:
  int64_t head_dim_, tokens_;
  double dropout_;
  torch::nn::AnyModule qkv_, proj_;
};
TORCH_MODULE(Attention);

// fc1 (kColumn) -> GELU -> fc2 (kRow). [.., D] -> [.., D].
class MlpBlockImpl : public torch::nn::Module {
 public:
  explicit MlpBlockImpl(const TransformerBlockOptions& o);
  at::Tensor forward(const at::Tensor& x);
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& x);

 private:
  double dropout_;
  torch::nn::AnyModule fc1_, fc2_;
};
TORCH_MODULE(MlpBlock);

// LayerScale: x * gamma, gamma [D] a learned per-channel scale (`<name>.gamma`, timm's name).
class LayerScaleImpl : public torch::nn::Module {
 public:
  LayerScaleImpl(int64_t dim, double init);
  at::Tensor forward(const at::Tensor& x) { return x * gamma.to(x.scalar_type()); }
  at::Tensor gamma;
};
TORCH_MODULE(LayerScale);

// Pre-norm block: x + attn(ln1(x)), then + mlp(ln2(x)); with LayerScale, each residual branch
// is scaled by its ls1 / ls2 first.
class TransformerBlock : public Block {
 public:
  explicit TransformerBlock(const TransformerBlockOptions& o);
  at::Tensor forward_impl(const at::Tensor& x) override;
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& x) override;
  Cost cost() const override { return analytic_cost(opts_); }
  static Cost analytic_cost(const TransformerBlockOptions& o);

 private:
  TransformerBlockOptions opts_;
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr};
  Attention attn_{nullptr};
  MlpBlock mlp_{nullptr};
  LayerScale ls1_{nullptr}, ls2_{nullptr};  // empty without VitSpec::layer_scale
};

struct VisionTransformerOptions {
  VitSpec spec;
  int64_t image_h = 224, image_w = 224;
  bool class_token = false;  // or spec.class_token
  LinearFactory linear = dense_linear;
  units::TpLayersPtr tp = nullptr;  // see TransformerBlockOptions
};

// Patch embedding (conv kernel = stride = patch) + [prefix tokens] + learned position embedding
// + blocks + final LayerNorm. forward(images [B, 3, H, W], any memory format) -> tokens
// [B, T, D] with T = prefix_tokens() + grid_h() * grid_w(), the prefix tokens first (class token
// at index 0, then the registers).
class VisionTransformerImpl : public torch::nn::Module {
 public:
  explicit VisionTransformerImpl(const VisionTransformerOptions& o);
  // final_norm(blocks(embed(images))).
  at::Tensor forward(const at::Tensor& images);
  // The pieces of forward(), so a model can run them as separate units (models/model.h): the
  // patch embedding with [class token] and position embedding (reads patch_embed, cls_token,
  // pos_embed), then each of blocks(), then the final LayerNorm (reads norm). Under sequence
  // parallelism embed() returns this rank's row shard of the tokens and final_norm() takes it and
  // returns the whole [B, T, D] on every rank.
  at::Tensor embed(const at::Tensor& images);
  at::Tensor final_norm(const at::Tensor& x);
  // The dtype of the patch embedding's weight: what embed() takes images in.
  at::ScalarType param_dtype() const { return patch_embed_->weight.scalar_type(); }
  // forward() of normalised images [B, 3, H, W] in e.dtype() as ONNX nodes: tokens [B, T, D]; and
  // its pieces, as embed() and final_norm() (blocks: each block's own emit_onnx in its scope).
  onnx::Value emit_onnx(onnx::Emitter& e, const onnx::Value& images);
  onnx::Value emit_embed(onnx::Emitter& e, const onnx::Value& images);
  onnx::Value emit_block(onnx::Emitter& e, int64_t index, const onnx::Value& x);
  onnx::Value emit_final_norm(onnx::Emitter& e, const onnx::Value& x);

  int64_t grid_h() const { return grid_of(opts_.image_h, opts_.spec); }
  int64_t grid_w() const { return grid_of(opts_.image_w, opts_.spec); }
  // Class token (either option) and register tokens, in front of the patch tokens.
  int64_t prefix_tokens() const { return (has_class_token() ? 1 : 0) + opts_.spec.reg_tokens; }
  bool has_class_token() const { return opts_.class_token || opts_.spec.class_token; }
  const VitSpec& spec() const { return opts_.spec; }
  // Patches along a side of `pixels` (padded up to a multiple of the patch with pad_to_patch).
  static int64_t grid_of(int64_t pixels, const VitSpec& s) {
    return s.pad_to_patch ? (pixels + s.patch - 1) / s.patch : pixels / s.patch;
  }
  const std::vector<std::shared_ptr<TransformerBlock>>& blocks() const { return blocks_; }
  Cost cost() const { return analytic_cost(opts_); }
  static Cost analytic_cost(const VisionTransformerOptions& o);

 private:
  VisionTransformerOptions opts_;
  QuantConv2d patch_embed_{nullptr};
  at::Tensor cls_token_, reg_token_, pos_embed_;
  std::vector<std::shared_ptr<TransformerBlock>> blocks_;
  torch::nn::LayerNorm norm_{nullptr};
};
TORCH_MODULE(VisionTransformer);

// `vit_cls`: ViT + class token + linear head on the class token's final feature.
// Batch: "images" [B, 3, H, W] uint8 (scaled to [0, 1] and normalised with ImageNet mean/std) or
// floating point (taken as already normalised), "labels" int64 [B]. Prediction: "logits"
// [B, num_classes]; loss: cross-entropy ("ce", and "accuracy" as a metric term).
class VitClassifier : public Model {
 public:
  // `tp` (null: none): tensor-parallel blocks through `linear` and a column-parallel head with
  // gathered output.
  VitClassifier(const VitSpec& spec, int64_t image_size, int64_t num_classes,
                LinearFactory linear = dense_linear, units::TpLayersPtr tp = nullptr);

  core::TensorDict forward(const core::TensorDict& batch) override;
  // The chain (models/model.h): begin {images}; "vit.embed", each block, "head" -> {logits}.
  int chain_length() const override { return static_cast<int>(vit_->blocks().size()) + 2; }
  std::vector<at::Tensor> chain_begin(const core::TensorDict& batch) override;
  std::vector<at::Tensor> chain_unit(int unit, const core::TensorDict& batch,
                                     const std::vector<at::Tensor>& in) override;
  core::TensorDict chain_end(const core::TensorDict& batch,
                             const std::vector<at::Tensor>& out) override;
  LossOutput loss(const core::TensorDict& batch, const core::TensorDict& pred) override;
  double forward_flops_per_sample() const override { return cost().flops; }
  std::vector<std::shared_ptr<torch::nn::Module>> recomputable_blocks() override;
  // "vit.embed" (patch embedding, class token, position embedding), "vit.block<i>" per block,
  // "head" (the ViT's final LayerNorm and the linear head).
  std::vector<Unit> units() const override;
  // vit_layer_depth over "vit." (the head comes after the last block).
  std::optional<LayerDepth> layer_depth(const std::string& param_name) const override {
    return vit_layer_depth(param_name, "vit.", static_cast<int>(spec_.depth));
  }
  std::vector<UnitActivation> unit_activations(
      const ActivationQuery& q) const override;  // models/activations.cpp
  core::TensorDict postprocess(const core::TensorDict& pred) override;
  int64_t batch_size(const core::TensorDict& batch) const override {
    return batch.at("images").size(0);
  }
  core::TensorDict example_batch(int64_t n) const override;
  std::vector<ModuleCost> cost_breakdown() const override;
  std::optional<BackboneSite> backbone_site() const override {
    return BackboneSite{"vit.", "vit", vit_.get()};
  }
  // Input "images" uint8 [B, 3, S, S], output "logits" float32 [B, num_classes]; the units of
  // units() in order (models/onnx/vit_onnx.cpp).
  OnnxFlow emit_onnx_inputs(onnx::Emitter& e) override;
  std::vector<onnx::Value> emit_onnx_unit(onnx::Emitter& e, int unit,
                                          const OnnxFlow& flow) override;
  void emit_onnx_outputs(onnx::Emitter& e, const OnnxFlow& flow) override;

  Cost cost() const { return analytic_cost(spec_, image_size_, num_classes_); }
  static Cost analytic_cost(const VitSpec& spec, int64_t image_size, int64_t num_classes);

 private:
  VitSpec spec_;
  int64_t image_size_, num_classes_;
  VisionTransformer vit_{nullptr};
  torch::nn::AnyModule head_;
};

// Converts uint8 images to the parameters' dtype, scaled to [0, 1] and normalised with ImageNet
// mean/std; floating-point images are only cast. Keeps the memory format of `images`.
at::Tensor normalize_images(const at::Tensor& images, at::ScalarType dtype);

// LayerNorm that keeps x's dtype under autocast (which would run and return it in fp32); used on
// the ViT's residual stream, which stays in autocast's dtype (see vit.cpp). `fused`: through
// kernels::add_layer_norm when its CUDA kernel takes x.
at::Tensor layer_norm_in_dtype(torch::nn::LayerNorm& ln, const at::Tensor& x, bool fused = true);

// precision.mode=fp8: the linear layers of every ViT attention and MLP block inside `model` (qkv,
// proj, fc1, fc2; dense or tensor-parallel) compute in FP8 (kernels/fp8.h). The patch embedding,
// the heads and everything outside the blocks stay in bf16: the patch embedding and a
// classification head are a few percent of the FLOPs and the first and last layers are where
// FP8's rounding costs the most accuracy (torchao's and Transformer Engine's recipes leave them
// out too). Returns the number of layers; ConfigError naming the key when a layer cannot
// (a LoRA adapter or QAT quantizers on it, a shape that is not a multiple of 16).
int enable_fp8(torch::nn::Module& model, const kernels::fp8::Fp8Options& options);

}  // namespace parallax::models
