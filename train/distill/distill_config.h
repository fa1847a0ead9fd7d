// The `distill` config section (docs/configs.md, docs/trainers.md "Distillation"): the teacher and
// the weights of the loss terms. Apart from the trainer (distill.h) so that the run config
// (train/run_config.h) and every config reader see the section without compiling the trainer.
#pragma once

#include "core/config.h"

#include <string>

namespace parallax::train {

struct DistillConfig {
  std::string teacher;           // "" : off
  std::string teacher_size;      // "" : the student's model.size
  std::string teacher_backbone;  // "" : the student's model.backbone
  double temperature = 4.0;
  double student_loss = 1.0;
  double logit_kl = 1.0;
  double seg_kl = 0.0;
  double heatmap = 1.0;
  double feature = 1.0;
  std::string feature_norm = "channel";
  std::string adapter = "always";

  template <class V>
  void visit(V& v) {
    v("teacher", teacher,
      "the teacher's weights: a run directory, a checkpoint or a weights.h5 ('' : no "
      "distillation)");
    v("teacher_size", teacher_size, "the teacher's model.size ('' : the student's)",
      core::Check::one_of({"", "tiny", "small", "base", "large", "3b", "b16"}));
    v("teacher_backbone", teacher_backbone, "the teacher's model.backbone ('' : the student's)",
      core::Check::one_of({"", "vit", "conv"}));
    v("temperature", temperature, "softmax temperature T of the KL term (scaled by T^2)",
      core::Check::positive());
    v("student_loss", student_loss, "weight of the student's own task loss",
      core::Check::at_least(0));
    v("logit_kl", logit_kl, "vit_cls: weight of the KL term on the class logits (Hinton et al.)",
      core::Check::at_least(0));
    v("seg_kl", seg_kl,
      "bev: weight of the KL term on every BEV cell's segmentation logits (0 by default: measured "
      "to cost the student accuracy, docs/trainers.md)",
      core::Check::at_least(0));
    v("heatmap", heatmap, "weight of the MSE between the sigmoid detection heatmaps (bev)",
      core::Check::at_least(0));
    v("feature", feature,
      "bev: weight of the MSE between the student's and the teacher's BEV feature maps; the "
      "student's go through a learned 1x1 projection first (distill.adapter: always by default, "
      "auto only when the channel counts differ) and both are standardised per "
      "distill.feature_norm (0: no feature term, no projection)",
      core::Check::at_least(0));
    v("feature_norm", feature_norm,
      "feature KD on standardised maps: channel = each channel of each sample to zero mean and "
      "unit variance over the BEV cells, for the student (after the adapter) and the teacher "
      "alike, so the term weighs how the maps' patterns agree, not their scales (PKD, Cao et al. "
      "2022); none = raw features",
      core::Check::one_of({"channel", "none"}));
    v("adapter", adapter,
      "the learned 1x1 convolution student -> teacher channels before feature KD: auto = only "
      "when the channel counts differ, always = also when they match (students and teachers of "
      "different backbones encode their channels differently)",
      core::Check::one_of({"auto", "always"}));
  }
};

}  // namespace parallax::train
