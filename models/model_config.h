// The `model` config section: which model of the zoo, at which size, and its knobs.
// Size presets (backbone shapes, BEV channels, query resolution, heights) are in
// models/perception_model.cpp and documented in docs/models.md; the keys below override them.
#pragma once

#include "core/config.h"

#include <string>

namespace parallax::models {

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

  template <class V>
  void visit(V& v) {
    v("name", name, "model family: bev (perception) | vit_cls (classification) | mlp (stand-in)",
      core::Check::one_of({"bev", "vit_cls", "mlp"}));
    v("size", size, "size preset",
      core::Check::one_of({"tiny", "small", "base", "large", "3b", "b16"}));
    v("backbone", backbone, "image backbone", core::Check::one_of({"vit", "conv"}));
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
  }
};

}  // namespace parallax::models
