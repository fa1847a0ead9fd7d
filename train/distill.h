// Knowledge distillation (`distill` config section, docs/trainers.md): a frozen teacher, loaded
// from its own run, guides the student through extra loss terms. Built on the Trainer's extension
// points (train/trainer.h): a frozen model, extra loss terms, and a model transform that adds the
// feature projection.
//
// The teacher is the student's model section with `distill.teacher_size` / `teacher_backbone`
// overrides (a larger size, or the other backbone), built for the same scene, loaded from
// `distill.teacher` (a run directory, a checkpoint or a weights.h5: strict, so a teacher that does
// not fit its model is an error naming the tensors), in eval mode, with no gradients and never in
// the optimizer or the gradient buckets; it runs under no-grad inside the student's autocast. Its
// attention-kernel choice is the student's (the SDPA order is process-wide: building the teacher
// restores the student's).
//
// Loss terms, each weighted and logged as loss_<name>:
//   logit_kl (vit_cls) T^2 KL(softmax(teacher / T) || softmax(student / T)) over the class
//            logits, mean over samples (Hinton et al. 2015);
//   seg_kl   (bev) the same over the segmentation classes of every BEV cell, mean over cells and
//            samples; off by default (issue 40: on bev_tiny the KL alone cost the student 0.06
//            mIoU and 0.09 mAP; the unweighted mean over cells is mostly background, where the
//            task's cross-entropy weighs classes by 1/sqrt(frequency); docs/trainers.md);
//   heatmap  mean squared error between the sigmoid detection heatmaps (bev);
//   feature  mean squared error between the BEV feature maps (the BEV encoder's output), through a
//            learned 1x1 convolution student -> teacher channels (the adapter) when the counts
//            differ (distill.adapter=always: also when they match), each map standardised per
//            sample and channel over the BEV cells first (distill.feature_norm=channel, the
//            default; PKD, Cao et al. 2022): raw feature scales differ between backbones by
//            orders of magnitude, and an unnormalised MSE either swamps the task loss or vanishes.
//            The adapter is a training-only module of the student ("aux.distill_proj": in the
//            last unit, checkpointed, never exported; models/model.h).
// A teacher whose query grid differs from the student's (another size: bev small has 0.5 m cells,
// tiny 1 m) has its heatmap and features bilinearly resampled to the student's grid; the
// segmentation logits are on the dataset's label grid for every size.
// `distill.student_loss` weights the model's own task loss (the total is student_loss x task +
// the terms).
//
// Parallelism: under DDP and ZeRO-1/2 the teacher is replicated on every rank (it has no gradients
// or optimizer state: its parameters and buffers only). ZeRO-3 is refused with a ConfigError (the
// projection runs outside the model's units, where ZeRO-3 keeps parameters sharded).
#pragma once

#include "core/config.h"
#include "core/scene.h"
#include "core/tensor_dict.h"
#include "models/model.h"

#include <map>
#include <memory>
#include <string>

namespace parallax::train {

struct RunConfig;
struct TrainerHooks;

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

namespace distill {

// The teacher of `cfg` for `scene`, loaded and frozen (eval, no gradients), on the CPU. ConfigError
// naming the key for a missing teacher path or an unknown size; CheckpointError naming the tensors
// for weights that do not fit the teacher's model.
std::shared_ptr<models::Model> build_teacher(const RunConfig& cfg, const core::SceneSpec& scene);

// The weighted loss terms of one micro-batch ("seg_kl", "heatmap", "feature"; a zero weight drops
// its term): `pred` is the student's forward, `teacher_pred` the teacher's; `projection` (may be
// null) maps the student's BEV features to the teacher's channels.
std::map<std::string, at::Tensor> loss_terms(const DistillConfig& cfg, const core::TensorDict& pred,
                                             const core::TensorDict& teacher_pred,
                                             torch::nn::Module* projection);

// The Trainer's hooks for a distillation run of `cfg` (cfg.distill.teacher set). The hooks keep a
// pointer to `cfg`, which must outlive the Trainer.
TrainerHooks hooks(const RunConfig& cfg);

}  // namespace distill
}  // namespace parallax::train
