// The `model` config section: which model of the zoo, at which size, and its knobs.
// Size presets (backbone shapes, BEV channels, query resolution, heights) are in
// models/perception_model.cpp and documented in docs/models.md; the keys below override them.
#pragma once

#include "core/config.h"

#include <string>
#include <vector>

namespace parallax::models {

// model.temporal (bev): fuse the BEV features of the previous keyframes, aligned to the current
// ego frame by the ego motion (models/temporal.h; docs/models.md, "Temporal fusion").
struct TemporalConfig {
  int frames = 1;          // keyframes seen per sample, the current one included; 1 = off
  bool prev_grad = false;  // backpropagate through the previous frames (BEVDet4D: no)

  template <class V>
  void visit(V& v) {
    v("frames", frames,
      "bev: keyframes per sample, the current one included (1: single-frame; needs data.frames "
      "equal to it)",
      core::Check::between(1, 16));
    v("prev_grad", prev_grad,
      "bev: train the image backbone and view transformer through the previous frames too "
      "(false, as BEVDet4D: they run without gradient, saving their activations' memory)");
  }
};

// model.pretrained: where train.load_from's weights come from and what they initialise
// (checkpoint/pretrained.h; docs/pretrained.md).
struct PretrainedConfig {
  std::string source = "parallax";
  std::string target = "model";
  std::string prefix;
  std::vector<std::string> rules;
  bool strict = false;

  template <class V>
  void visit(V& v) {
    v("source", source,
      "naming convention of train.load_from's file: parallax (Parallax's names), timm (timm's "
      "ViTs and DINOv2's release; timm's ResNets), torchvision (ResNets), hf (transformers' ViT "
      "and DINOv2)",
      core::Check::one_of({"parallax", "timm", "torchvision", "hf"}));
    v("target", target,
      "what the weights initialise: model (the whole model) or backbone (the image backbone only)",
      core::Check::one_of({"model", "backbone"}));
    v("prefix", prefix,
      "take only the file's tensors under this prefix, stripped (e.g. 'backbone.' of a detector)");
    v("rules", rules,
      "renames applied to the file's names before the convention, each 'regex -> replacement' "
      "($1 for groups); a rule that matches nothing is an error");
    v("strict", strict,
      "foreign files (safetensors, torch.save): refuse a load with missing, unexpected or "
      "mismatched tensors (Parallax checkpoints and weights.h5 follow train.strict_load)");
  }
};

struct ModelConfig {
  std::string name = "bev";
  std::string size = "tiny";
  std::string backbone = "vit";
  int num_classes = 1000;  // vit_cls only
  double dropout = 0.0;
  // Fused attention kernel tried first by at::scaled_dot_product_attention (process-wide);
  // auto keeps LibTorch's order (flash, memory-efficient, math, cuDNN). Falls back down the
  // order when the first cannot take the inputs.
  std::string attention = "auto";
  // Transformer residual stream and LayerNorms in fp32 under autocast (eager PyTorch's numerics)
  // rather than in autocast's dtype (Megatron-Core's default, less memory traffic).
  bool fp32_residual = false;
  // Parallax's fused CUDA kernels (kernels/): residual add + LayerNorm forward and backward in one
  // kernel each, qkv-gradient packing, and the BEV view transformer's sampling and camera mean.
  // false: the same math with ATen ops.
  bool fused_kernels = true;
  // bev only.
  double bev_resolution = 0.0;  // metres per BEV query cell; 0 = the size's preset
  int bev_heights = 0;          // reference points per pillar; 0 = the size's preset
  double seg_loss_weight = 1.0;
  double heatmap_loss_weight = 1.0;
  double box_loss_weight = 0.25;
  double score_threshold = 0.05;
  int max_detections = 100;
  // bev: the detection head also regresses each box's ground velocity (vx, vy), CenterPoint's
  // two extra code channels, trained where the data knows the velocity.
  bool velocity = false;
  TemporalConfig temporal;
  PretrainedConfig pretrained;

  template <class V>
  void visit(V& v) {
    v("name", name, "model family: bev (perception) | vit_cls (classification) | mlp (stand-in)",
      core::Check::one_of({"bev", "vit_cls", "mlp"}));
    v("size", size, "size preset",
      core::Check::one_of({"tiny", "small", "base", "large", "3b", "b16"}));
    v("backbone", backbone,
      "image backbone: vit (shaped by model.size), conv, resnet50 / resnet101 (bev: torchvision's "
      "ResNet with frozen batch norm and an FPN, stride 16, images divisible by 32), or a named "
      "ViT of timm's for pretrained weights (the named ViTs and ResNets keep their own shape at "
      "every size; the ViTs pad images to whole patches)",
      core::Check::one_of({"vit", "conv", "resnet50", "resnet101", "vit_small_patch16",
                           "vit_base_patch16", "vit_large_patch16", "vit_small_patch14_dinov2",
                           "vit_base_patch14_dinov2", "vit_large_patch14_dinov2",
                           "vit_small_patch14_reg4_dinov2", "vit_base_patch14_reg4_dinov2",
                           "vit_large_patch14_reg4_dinov2"}));
    v("num_classes", num_classes, "classes of the classification head (vit_cls)",
      core::Check::at_least(1));
    v("dropout", dropout, "dropout probability", core::Check::between(0, 1));
    v("attention", attention,
      "fused attention kernel tried first (GPU): auto | cudnn | flash | fa3 | efficient | math",
      core::Check::one_of({"auto", "cudnn", "flash", "fa3", "efficient", "math"}));
    v("fp32_residual", fp32_residual,
      "keep the transformer residual stream and LayerNorms in fp32 under autocast");
    v("fused_kernels", fused_kernels,
      "fused CUDA kernels: residual add + LayerNorm, qkv-gradient packing, BEV sampling (false: "
      "ATen ops)");
    v("bev_resolution", bev_resolution, "bev: metres per BEV query cell (0: the size's preset)",
      core::Check::at_least(0));
    v("bev_heights", bev_heights, "bev: reference heights per BEV pillar (0: the size's preset)",
      core::Check::at_least(0));
    v("seg_loss_weight", seg_loss_weight, "bev: weight of the BEV segmentation cross-entropy",
      core::Check::at_least(0));
    v("heatmap_loss_weight", heatmap_loss_weight, "bev: weight of the detection heatmap focal loss",
      core::Check::at_least(0));
    v("box_loss_weight", box_loss_weight, "bev: weight of the box regression L1 loss",
      core::Check::at_least(0));
    v("score_threshold", score_threshold, "bev: minimum heatmap score of a decoded detection",
      core::Check::between(0, 1));
    v("max_detections", max_detections, "bev: detections per sample after top-K",
      core::Check::at_least(1));
    v("velocity", velocity,
      "bev: the detection head predicts each box's velocity (vx, vy) in m/s, trained on the "
      "boxes whose velocity the data holds (datagen --sequence-length > 1, converted nuScenes)");
    v("temporal", temporal);
    v("pretrained", pretrained);
  }
};

}  // namespace parallax::models
