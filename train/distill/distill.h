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

#include "core/scene.h"
#include "core/tensor_dict.h"
#include "models/model.h"
#include "train/distill/distill_config.h"

#include <map>
#include <memory>
#include <string>

namespace parallax::train {

struct RunConfig;
struct TrainerHooks;
class Extension;

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
// The `distill` section of `cfg` (train/config_sections.h).
const DistillConfig& config(const RunConfig& cfg);
DistillConfig& config(RunConfig& cfg);
// Distillation as a trainer extension (train/extension.h; registered in train/extensions.cpp).
const Extension& extension();

}  // namespace distill
}  // namespace parallax::train
