// The activation model of the zoo (Model::unit_activations): the bytes one sample's forward keeps
// for its backward, unit by unit, from the layers' shapes. Each term names the tensor autograd
// saves (docs/planning.md lists them); train/planner.cpp multiplies by the micro-batch and the
// pipeline schedule's in-flight micro-batches, and tests/train/planner_test.cpp holds the totals
// to within 15% of what a CPU forward really keeps.
//
// Conventions. e: bytes of the compute dtype (2 under bf16/fp16 autocast, else 4); s: bytes of the
// ViT residual stream (e, or 4 with fp32_residual). A tensor two layers save (a ReLU's output that
// the next convolution takes) counts once, in the unit that made it; where CUDA autocast runs the
// norm in fp32, the convolution saves its own cast copy, which counts in its unit.
#include "models/mlp.h"
#include "models/perception_model.h"
#include "models/resnet.h"
#include "models/vit.h"

#include <algorithm>

namespace parallax::models {

namespace {

struct BlockShape {
  double tokens, dim, hidden, heads;
};

// One transformer block (vit.cpp, TransformerBlock::forward_impl), per sample of `tokens` tokens:
//   LayerNorm 1 input x (s) + its mean/rstd (8), its output as qkv's input (e), qkv's output
//   (3e: SDPA saves q, k, v as views of it), SDPA's output (e) and logsumexp (4 per head), the
//   head-merged copy proj takes (e), the fused add+LayerNorm's input y (s) and stats (8), fc1's
//   input (e), GELU's input (e f) and fc2's input (e f).
// Under fp8 (kernels/fp8.h) the four linear layers save their inputs as FP8 copies (the transposed
// layout the weight gradient's GEMM reads, 1 byte per element) instead of e; the tensors they were
// cast from (the LayerNorm outputs, the head-merged copy, GELU's output) are then saved by nobody.
// Under tp the column-parallel outputs (qkv, attention, fc1, GELU) are 1/tp; under sequence
// parallelism so are the LayerNorm regions, while each column layer saves its all-gathered input.
double block_saved(const BlockShape& b, const ActivationQuery& q, double s) {
  const double e = q.compute_bytes, t = q.tp;
  const double li = q.fp8 ? 1 : e;  // a linear layer's saved input, bytes per element
  const double region = q.sequence_parallel ? 1.0 / t : 1.0;
  // Without autocast the LayerNorm output is the linear's input itself; with it the linear casts
  // (and saves) its own copy: either way e bytes per element.
  const double norms = region * (2 * s * b.dim + 16);
  const double column_inputs = 2 * li * b.dim;  // qkv's and fc1's inputs (gathered under SP)
  const double sharded =
      (3 * e * b.dim + e * b.dim + 4 * b.heads + li * b.dim + e * b.hidden + li * b.hidden) / t;
  return b.tokens * (norms + column_inputs + sharded);
}

double block_output(const BlockShape& b, const ActivationQuery& q, double s) {
  return b.tokens * b.dim * s / (q.sequence_parallel ? q.tp : 1);
}

// The patch embedding (VisionTransformerImpl::embed): the patch rows the GEMM saves (e).
double embed_saved(int64_t image_h, int64_t image_w, const ActivationQuery& q) {
  return 3.0 * static_cast<double>(image_h * image_w) * q.compute_bytes;
}

// Bytes of GroupNorm's input and output (and so of the ReLU after it): CUDA autocast runs
// group_norm in fp32; CPU autocast keeps it in the autocast dtype.
double norm_bytes(const ActivationQuery& q) {
  return q.cuda ? 4 : q.compute_bytes;
}

// A ConvNormAct (layers.cpp) producing `out` x `hw` from `in` x `in_hw`: the convolution's input
// (its own cast copy when the tensor it gets is not in the compute dtype; otherwise the tensor the
// layer before saved, counted there unless `input_fresh`), GroupNorm's input (the conv output, or
// its fp32 cast) and the in-place ReLU's output.
double cna_saved(double in, double in_hw, double out, double hw, bool act, bool input_fresh,
                 const ActivationQuery& q) {
  const double nb = norm_bytes(q);
  const bool cast = nb != q.compute_bytes;
  double b = (cast || input_fresh) ? in * in_hw * q.compute_bytes : 0;
  b += out * hw * nb;           // GroupNorm input
  if (act) b += out * hw * nb;  // ReLU output
  return b;
}

// A ResidualConvBlock: two ConvNormActs at `c` x `hw`, then (y + x).relu_(), whose output it saves
// (and the next block's first convolution takes).
double residual_saved(double c, double hw, bool input_fresh, const ActivationQuery& q) {
  const double nb = norm_bytes(q);
  return cna_saved(c, hw, c, hw, true, input_fresh, q) + cna_saved(c, hw, c, hw, false, false, q) +
         c * hw * nb;
}

// A ResNet Bottleneck (resnet.cpp) from `in` channels at `hw_in` pixels to 4 `width` at `hw_out`:
// every FrozenBatchNorm2d's multiply-add keeps its input (the convolution's output) and every
// in-place ReLU its output (the next convolution's input); the block's last ReLU output is the
// next block's input. Its own input counts here only when `input_fresh` (the stem's max-pool
// output, which nothing before saved). Under autocast every tensor is in the compute dtype: the
// convolutions return it and the norm computes in it.
UnitActivation::InnerBlock bottleneck_saved(double in, double width, double hw_in, double hw_out,
                                            bool downsample, bool input_fresh,
                                            const ActivationQuery& q) {
  const double e = q.compute_bytes, out = 4 * width;
  double b = input_fresh ? in * hw_in * e : 0;
  b += 2 * width * hw_in * e;             // bn1's input, relu's output (conv2's input)
  b += 2 * width * hw_out * e;            // bn2's input, relu's output (conv3's input)
  b += out * hw_out * e;                  // bn3's input
  if (downsample) b += out * hw_out * e;  // the downsample norm's input
  b += out * hw_out * e;                  // the final ReLU's output
  return {b, in * hw_in * e};
}

// The ResNet units of the bev encoder (ImageEncoderImpl::unit_paths), per image: the stem with
// layer1, layer2, layer3, then layer4 with the FPN, whose 3x3 convolution keeps its input P4 (the
// laterals' inputs C4 and C5 are counted where they were made; the upsample and add keep nothing).
std::vector<UnitActivation> resnet_units(const ImageEncoderOptions& eo, const ActivationQuery& q) {
  const double e = q.compute_bytes;
  const double h = static_cast<double>(eo.image_h), w = static_cast<double>(eo.image_w);
  const std::vector<int64_t> layers = resnet_layers(ImageEncoderImpl::resnet_depth(eo.backbone));
  std::vector<UnitActivation> out(4);
  // Stem: conv1's input (the images, or their cast copy), bn1's input and the ReLU output at
  // stride 2, the max-pool's int64 indices at stride 4.
  out[0].saved = 3 * h * w * e + 2 * 64 * (h * w / 4) * e + 64 * (h * w / 16) * 8;
  double in = 64, hw = h * w / 16;
  for (std::size_t s = 0; s < 4; ++s) {
    const double width = static_cast<double>(int64_t{64} << s), stride = s == 0 ? 1 : 2;
    for (int64_t b = 0; b < layers[s]; ++b) {
      const double hw_out = b == 0 ? hw / (stride * stride) : hw;
      const bool ds = b == 0;  // every stage's first block changes the channels
      out[s].inner.push_back(bottleneck_saved(in, width, hw, hw_out, ds, s == 0 && b == 0, q));
      out[s].saved += out[s].inner.back().saved;
      in = 4 * width;
      hw = hw_out;
    }
    out[s].output = in * hw * e;
  }
  const double oc = static_cast<double>(eo.out_channels);
  out[3].saved += oc * hw * 4 * e;  // P4 at stride 16 (hw is stride 32's)
  out[3].output = oc * hw * 4 * e;
  return out;
}

}  // namespace

std::vector<UnitActivation> VitClassifier::unit_activations(const ActivationQuery& q) const {
  const double s = spec_.fp32_residual ? 4 : q.compute_bytes;
  const double grid = static_cast<double>(image_size_ / spec_.patch);
  const BlockShape b{grid * grid + 1, static_cast<double>(spec_.dim),
                     static_cast<double>(spec_.mlp_hidden), static_cast<double>(spec_.heads)};
  std::vector<UnitActivation> out;
  out.push_back({embed_saved(image_size_, image_size_, q), block_output(b, q, s), false});
  for (int64_t i = 0; i < spec_.depth; ++i)
    out.push_back({block_saved(b, q, s), block_output(b, q, s), true});
  // The final LayerNorm's input and stats, the head's input (class token), the logits and
  // cross-entropy's log-softmax (fp32).
  const double classes = static_cast<double>(num_classes_);
  out.push_back(
      {b.tokens * (s * b.dim + 8) + b.dim * q.compute_bytes + 2 * classes * 4, classes * 4, false});
  return out;
}

std::vector<UnitActivation> PerceptionModel::unit_activations(const ActivationQuery& q) const {
  const ImageEncoderOptions& eo = spec_.encoder;
  const double cams = static_cast<double>(spec_.scene.num_cameras);
  const double e = q.compute_bytes;
  const int64_t stride = ImageEncoderImpl::stride_of(eo);
  const bool vit = eo.backbone == "vit";
  const double fhw =
      static_cast<double>(vit ? VisionTransformerImpl::grid_of(eo.image_h, eo.vit) *
                                    VisionTransformerImpl::grid_of(eo.image_w, eo.vit)
                              : (eo.image_h / stride) * (eo.image_w / stride));
  const double feat_out = cams * fhw * static_cast<double>(eo.out_channels) * e;
  std::vector<UnitActivation> out;
  if (vit) {
    const double s = eo.vit.fp32_residual ? 4 : e;
    const double tokens = fhw + static_cast<double>(eo.vit.prefix_tokens());
    const BlockShape b{tokens, static_cast<double>(eo.vit.dim),
                       static_cast<double>(eo.vit.mlp_hidden), static_cast<double>(eo.vit.heads)};
    out.push_back(
        {cams * embed_saved(eo.image_h, eo.image_w, q), cams * block_output(b, q, s), false});
    for (int64_t i = 0; i < eo.vit.depth; ++i)
      out.push_back({cams * block_saved(b, q, s), cams * block_output(b, q, s), true});
    // Neck: the final LayerNorm's input and stats, the linear's input.
    out.push_back({cams * b.tokens * (s * b.dim + 8 + e * b.dim), feat_out, false});
  } else if (ImageEncoderImpl::resnet_depth(eo.backbone) > 0) {
    for (UnitActivation u : resnet_units(eo, q)) {
      u.saved *= cams;
      u.output *= cams;
      for (auto& inner : u.inner) {
        inner.saved *= cams;
        inner.input *= cams;
      }
      out.push_back(u);
    }
  } else {
    // One unit: stride-2 ConvNormActs and residual blocks, then the 1x1 neck (its input saved).
    double saved = 0, in = 3, h = static_cast<double>(eo.image_h),
           w = static_cast<double>(eo.image_w);
    bool fresh = true;  // the normalised images: nothing saved them yet
    for (std::size_t st = 0; st < eo.conv.widths.size(); ++st) {
      const double c = static_cast<double>(eo.conv.widths[st]);
      saved += cna_saved(in, h * w, c, (h / 2) * (w / 2), true, fresh, q);
      h /= 2;
      w /= 2;
      fresh = false;
      for (int64_t k = 0; k < eo.conv.blocks[st]; ++k) saved += residual_saved(c, h * w, false, q);
      in = c;
    }
    if (norm_bytes(q) != e) saved += in * h * w * e;  // the neck's cast input
    out.push_back({cams * saved, feat_out, false});
  }
  // View transformer (view_transformer.cpp): sampling keeps the feature maps (the fused CUDA
  // kernel: as they are; the ATen path: an fp32 copy for grid_sampler), then lift1's input
  // [C Z + Z] per cell (e), GroupNorm's input and the ReLU output (fp32), lift2's cast input.
  const BevGrid& g = spec_.query_grid;
  const double cells = static_cast<double>(g.nx * g.ny),
               c = static_cast<double>(spec_.bev_channels);
  const double z = static_cast<double>(spec_.heights.size());
  const double feat_copy = cams * fhw * static_cast<double>(eo.out_channels) * (q.cuda ? e : 4);
  const double nb = norm_bytes(q);
  double view =
      feat_copy + (static_cast<double>(eo.out_channels) * z + z) * cells * e + 2 * c * cells * nb;
  if (nb != e) view += c * cells * e;
  out.push_back({view, c * cells * e, false});
  if (spec_.frames > 1) {
    // Frames > 1: each encoder unit and the view also carry the previous frames' outputs (F - 1
    // more), and keep their activations only with prev_grad. The temporal unit keeps the
    // concatenation (the fusing ConvNormAct's input) and the aligned maps' sampling grid.
    const double prev = static_cast<double>(spec_.frames - 1);
    for (UnitActivation& u : out) {
      u.output *= 1 + prev;
      if (spec_.prev_grad) {
        u.saved *= 1 + prev;
        for (auto& inner : u.inner) {
          inner.saved *= 1 + prev;
          inner.input *= 1 + prev;
        }
      }
    }
    const double f = static_cast<double>(spec_.frames);
    out.push_back({cna_saved(c * f, cells, c, cells, true, false, q) + prev * cells * 2 * 4 +
                       (spec_.prev_grad ? prev * c * cells * e : 0),
                   c * cells * nb, false});
  }
  for (int64_t i = 0; i < spec_.encoder_blocks; ++i)
    out.push_back({residual_saved(c, cells, i == 0, q), c * cells * nb, true});
  // Heads: three ConvNormAct branches on the BEV features (each casts its own input under
  // autocast), their 1x1 outputs' inputs (the ReLU outputs, counted), and the losses' fp32 maps:
  // log-softmax of the segmentation, the heatmap's sigmoid and focal terms.
  const double hc = static_cast<double>(spec_.head_channels);
  const double seg = static_cast<double>(spec_.scene.bev_classes.size());
  const double boxes = static_cast<double>(spec_.scene.box_classes.size());
  double heads = 3 * cna_saved(c, cells, hc, cells, true, false, q);
  if (nb != e) heads += 3 * hc * cells * e;
  heads += (2 * seg + 4 * boxes) * cells * 4;
  out.push_back({heads, (seg + boxes + 7) * cells * 4, false});
  return out;
}

std::vector<UnitActivation> MlpModel::unit_activations(const ActivationQuery& q) const {
  // Unit k: Linear (saves its input) then GELU (saves its input); the last unit is the output
  // Linear, whose output the MSE keeps (fp32).
  std::vector<UnitActivation> out;
  double width = static_cast<double>(in_);
  const double e = q.compute_bytes;
  for (int64_t i = 0; i < depth_; ++i) {
    const double h = static_cast<double>(hidden_);
    out.push_back({width * e + h * e, h * e, false});
    width = h;
  }
  out.push_back(
      {width * e + 2 * static_cast<double>(out_) * 4, static_cast<double>(out_) * e, false});
  return out;
}

}  // namespace parallax::models
