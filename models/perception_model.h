// `bev`: the multi-camera BEV perception model, one family in sizes tiny | small | base | large |
// 3b.
//
//   images [B, N, H, W, 3] uint8 --(normalise; shared image backbone + neck)--> [B*N, C, H/s, W/s]
//   --(view transformer: pillar reference points projected with the batch's cameras)--> BEV
//   [B, C, nx, ny] --(BEV encoder: residual conv blocks)--> heads:
//     "bev_logits" [B, n_bev_classes, X, Y]  segmentation logits on the dataset's label grid
//                                            (bilinearly resampled when the query grid differs)
//     "heatmap"    [B, n_box_classes, nx, ny] CenterPoint class heatmap logits on the query grid
//     "box_reg"    [B, 8, nx, ny]             box codes (models/detection.h)
//
// Batches follow docs/data.md: it reads "images", "intrinsics", "cam_to_ego" in forward() and
// "bev_semantics", "boxes" in loss(). With model.temporal.frames = F > 1 (models/temporal.h) it
// also reads the F - 1 previous keyframes, nearest first: "prev_images" [B, F-1, N, H, W, 3],
// "prev_intrinsics" [B, F-1, N, 3, 3], "prev_cam_to_ego" [B, F-1, N, 4, 4] (each in its own ego
// frame) and "prev_to_current" [B, F-1, 4, 4] (that ego frame's pose in the current one); the
// chain carries {current, previous} through the image encoder and the view transformer, and a
// "temporal" unit after the view aligns and fuses them. postprocess() gives "bev_labels",
// "det_boxes", "det_scores". The model is built for one SceneSpec (cameras, image size, BEV grid,
// classes) and checks batches against it.
#pragma once

#include "models/backbone.h"
#include "models/bev_grid.h"
#include "models/detection.h"
#include "models/model.h"
#include "models/temporal.h"
#include "models/view_transformer.h"

#include <string>
#include <vector>

namespace parallax::models {

// Everything that defines a bev model, resolved from (ModelConfig, SceneSpec).
struct BevModelSpec {
  std::string size = "tiny";
  ImageEncoderOptions encoder;  // backbone choice, ViT/conv shapes, image size, out channels
  core::SceneSpec scene;
  BevGrid query_grid;
  std::vector<double> heights;
  int64_t bev_channels = 64;
  int64_t head_channels = 32;
  int64_t encoder_blocks = 2;
  double seg_loss_weight = 1.0, heatmap_loss_weight = 1.0, box_loss_weight = 0.25;
  double score_threshold = 0.05;
  int64_t max_detections = 100;
  bool velocity = false;   // the detection head regresses (vx, vy) (model.velocity)
  int64_t frames = 1;      // keyframes per sample (model.temporal.frames; models/temporal.h)
  bool prev_grad = false;  // gradients through the previous frames (model.temporal.prev_grad)

  BevGrid label_grid() const;
};

// Resolves the size preset and the config's overrides for `scene`; throws ConfigError naming the
// key for an unknown size or a scene the model cannot take (e.g. image size not divisible by the
// backbone stride).
BevModelSpec make_bev_spec(const ModelConfig& cfg, const core::SceneSpec& scene);

// The scene each size is benchmarked at (docs/models.md): tiny uses the synthetic dataset's
// defaults (6 x 128 x 224, 100 x 100 BEV at 0.5 m); the GPU sizes use 6 x 256 x 704 images
// (BEVDet's input) and a 100 m x 100 m BEV label grid at 0.5 m (200 x 200).
core::SceneSpec benchmark_scene(const std::string& size);

// Segmentation and detection heads: per task a 3x3 ConvNormAct to head_channels and a 1x1 conv.
class BevHeadsImpl : public torch::nn::Module {
 public:
  // `code_size`: the box regression channels (models/detection.h box_code_size: 8, 10 with
  // velocity).
  BevHeadsImpl(int64_t channels, int64_t head_channels, int64_t seg_classes, int64_t box_classes,
               int64_t nx, int64_t ny, int64_t code_size = kBoxCodeSize);
  core::TensorDict forward(const at::Tensor& bev);  // "seg", "heatmap", "box_reg" on the query grid
  // forward() as ONNX nodes: {seg, heatmap, box_reg}.
  std::vector<onnx::Value> emit_onnx(onnx::Emitter& e, const onnx::Value& bev);
  Cost cost() const {
    return analytic_cost(channels_, head_channels_, seg_classes_, box_classes_, nx_, ny_,
                         code_size_);
  }
  static Cost analytic_cost(int64_t channels, int64_t head_channels, int64_t seg_classes,
                            int64_t box_classes, int64_t nx, int64_t ny,
                            int64_t code_size = kBoxCodeSize);
  int64_t code_size() const { return code_size_; }

 private:
  int64_t channels_, head_channels_, seg_classes_, box_classes_, nx_, ny_, code_size_;
  ConvNormAct seg_conv_{nullptr}, heat_conv_{nullptr}, reg_conv_{nullptr};
  QuantConv2d seg_out_{nullptr}, heat_out_{nullptr}, reg_out_{nullptr};
};
TORCH_MODULE(BevHeads);

class PerceptionModel : public Model {
 public:
  // `linear` and `tp`: the ViT backbone's blocks tensor-parallel (models/vit.h); the conv
  // backbone, view transformer, BEV encoder and heads stay replicated.
  explicit PerceptionModel(const BevModelSpec& spec, LinearFactory linear = dense_linear,
                           units::TpLayersPtr tp = nullptr);

  core::TensorDict forward(const core::TensorDict& batch) override;
  // The chain (models/model.h): begin {images}; the units of units() in order; the heads unit
  // returns {seg, heatmap, box_reg} (and the BEV features with set_feature_output).
  int chain_length() const override;
  // analytic_cost()'s components over the units: the backbone's FLOPs shared by the encoder's
  // units in proportion to their parameters (a ViT's embedding and blocks are GEMMs over the same
  // tokens; a ResNet's units have their own counts, ImageEncoderImpl::unit_flops), the view
  // transformer's to its unit, the BEV encoder's equally over its blocks, the
  // heads' to theirs.
  std::vector<double> unit_flops() const override;
  std::vector<at::Tensor> chain_begin(const core::TensorDict& batch) override;
  std::vector<at::Tensor> chain_unit(int unit, const core::TensorDict& batch,
                                     const std::vector<at::Tensor>& in) override;
  core::TensorDict chain_end(const core::TensorDict& batch,
                             const std::vector<at::Tensor>& out) override;
  LossOutput loss(const core::TensorDict& batch, const core::TensorDict& pred) override;
  double forward_flops_per_sample() const override;
  // Every residual/transformer block: image backbone blocks, then BEV encoder blocks.
  std::vector<std::shared_ptr<torch::nn::Module>> recomputable_blocks() override;
  // The image encoder's units (ViT: "encoder.vit.embed", "encoder.vit.block<i>", "encoder.neck";
  // conv: "encoder"; ResNet: "encoder.resnet.layer<1..3>", "encoder.fpn"), "view", "bev_block<i>",
  // "heads" (the three heads and the resampling of the segmentation logits to the label grid).
  std::vector<Unit> units() const override;
  // ViT backbone: its layers (vit_layer_depth over "encoder.vit."; the view transformer, BEV
  // encoder and heads come after the last block). Conv backbone: none.
  std::optional<LayerDepth> layer_depth(const std::string& param_name) const override {
    if (spec_.encoder.backbone != "vit") return std::nullopt;
    return vit_layer_depth(param_name, "encoder.vit.", static_cast<int>(spec_.encoder.vit.depth));
  }
  std::vector<UnitActivation> unit_activations(
      const ActivationQuery& q) const override;  // models/activations.cpp
  core::TensorDict postprocess(const core::TensorDict& pred) override;
  int64_t batch_size(const core::TensorDict& batch) const override {
    return batch.at("images").size(0);
  }
  // Random noise images on a jittered surround rig (models/camera_rig.h), 2-8 random boxes per
  // sample (class-typical sizes, visibility computed through the cameras) and BEV semantics
  // consistent with them (a road band with lane markings, box footprints on top).
  core::TensorDict example_batch(int64_t n) const override;
  std::vector<ModuleCost> cost_breakdown() const override { return analytic_cost(spec_); }
  // Inputs "images" uint8 [B, N, H, W, 3], "intrinsics" float32 [B, N, 3, 3], "cam_to_ego" float32
  // [B, N, 4, 4]; outputs "bev_logits", "heatmap", "box_reg" (float32, shapes as forward()); the
  // units of units() in order (models/onnx/bev_onnx.cpp).
  OnnxFlow emit_onnx_inputs(onnx::Emitter& e) override;
  std::vector<onnx::Value> emit_onnx_unit(onnx::Emitter& e, int unit,
                                          const OnnxFlow& flow) override;
  void emit_onnx_outputs(onnx::Emitter& e, const OnnxFlow& flow) override;
  std::string graph_capture_blocker() const override {
    return "the view transformer samples as many points per camera as the batch's cameras see (one "
           "host read of "
           "the counts per forward), so the step's shapes depend on the data";
  }

  static std::vector<ModuleCost> analytic_cost(const BevModelSpec& spec);
  const BevModelSpec& spec() const { return spec_; }
  ImageEncoder& encoder() { return encoder_; }
  std::optional<BackboneSite> backbone_site() const override;
  // forward() also returns "bev_features" [B, bev_channels, nx, ny], the BEV encoder's output that
  // the heads read (feature distillation, train/distill/distill.h). Off by default.
  void set_feature_output(bool on) { feature_output_ = on; }
  ViewTransformer& view_transformer() { return view_; }

 private:
  void check_batch(const core::TensorDict& batch) const;
  // Frames > 1: the image encoder's unit `unit` or the view transformer on the previous frames
  // (without gradient unless prev_grad).
  at::Tensor previous_frames(int unit, const core::TensorDict& batch, const at::Tensor& x);
  // The temporal unit's index (frames > 1), -1 otherwise.
  int temporal_unit() const;

  BevModelSpec spec_;
  ImageEncoder encoder_{nullptr};
  ViewTransformer view_{nullptr};
  TemporalFusion temporal_{nullptr};  // frames > 1 only
  std::vector<std::shared_ptr<ResidualConvBlock>> bev_blocks_;
  BevHeads heads_{nullptr};
  std::vector<int64_t> box_to_bev_class_;  // box class -> bev class index (-1 if absent)
  bool feature_output_ = false;
};

}  // namespace parallax::models
