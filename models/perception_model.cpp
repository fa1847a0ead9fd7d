#include "models/perception_model.h"
#include "units/param_init.h"

#include "core/error.h"
#include "models/camera_rig.h"
#include "models/detection.h"
#include "models/geometry.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numbers>
#include <optional>

namespace parallax::models {

namespace {

struct SizePreset {
  VitSpec vit;
  ConvBackboneSpec conv;
  double bev_resolution;  // metres per query cell
  int64_t heights, bev_channels, head_channels, encoder_blocks;
};

SizePreset size_preset(const std::string& size) {
  // ViT shapes: dim, depth, heads, mlp_hidden, patch.
  if (size == "tiny") return {{96, 2, 4, 384, 8}, {{24, 48, 96}, {0, 1, 1}}, 1.0, 4, 64, 32, 2};
  if (size == "small")
    return {{384, 12, 6, 1536, 16}, {{32, 64, 128, 256}, {0, 1, 2, 2}}, 0.5, 4, 128, 64, 2};
  if (size == "base")
    return {{768, 12, 12, 3072, 16}, {{64, 128, 256, 512}, {1, 2, 2, 2}}, 0.5, 4, 256, 128, 3};
  if (size == "large")
    return {{1024, 24, 16, 4096, 16}, {{96, 192, 384, 768}, {1, 2, 3, 2}}, 0.5, 8, 256, 128, 4};
  if (size == "3b")
    return {{2560, 36, 32, 10240, 16}, {{128, 256, 512, 1024}, {2, 3, 4, 3}}, 0.5, 8, 384, 192, 4};
  throw_error<ConfigError>(
      "key 'model.size': model 'bev' has sizes tiny|small|base|large|3b, got '{}'", size);
}

int64_t class_index(const std::vector<std::string>& names, const std::string& name) {
  auto it = std::find(names.begin(), names.end(), name);
  return it == names.end() ? -1 : static_cast<int64_t>(it - names.begin());
}

// Typical (l, w, h) in metres for a box class name.
std::array<double, 3> typical_size(const std::string& name) {
  if (name == "vehicle" || name == "car") return {4.5, 1.9, 1.6};
  if (name == "pedestrian") return {0.7, 0.7, 1.75};
  if (name == "cyclist" || name == "bicycle") return {1.8, 0.7, 1.6};
  return {2.0, 1.0, 1.5};
}

}  // namespace

std::optional<BackboneSite> PerceptionModel::backbone_site() const {
  if (const VisionTransformerImpl* vit = encoder_->vit())
    return BackboneSite{"encoder.vit.", "vit", vit};
  if (spec_.encoder.backbone.rfind("resnet", 0) == 0)
    return BackboneSite{"encoder.resnet.", "resnet", nullptr};
  return BackboneSite{"encoder.conv.", "conv", nullptr};
}

BevGrid BevModelSpec::label_grid() const {
  return {scene.x_min, scene.y_min, scene.bev_resolution, scene.bev_x_cells(), scene.bev_y_cells()};
}

BevModelSpec make_bev_spec(const ModelConfig& cfg, const core::SceneSpec& scene) {
  const SizePreset p = size_preset(cfg.size);
  PARALLAX_CHECK(scene.num_cameras >= 1 && scene.image_height > 0 && scene.image_width > 0,
                 ConfigError,
                 "model 'bev': the scene needs cameras and an image size, got {} cameras of {}x{}",
                 scene.num_cameras, scene.image_height, scene.image_width);
  PARALLAX_CHECK(scene.x_max > scene.x_min && scene.y_max > scene.y_min && scene.bev_resolution > 0,
                 ConfigError, "model 'bev': invalid BEV grid x [{}, {}], y [{}, {}], resolution {}",
                 scene.x_min, scene.x_max, scene.y_min, scene.y_max, scene.bev_resolution);
  PARALLAX_CHECK(!scene.bev_classes.empty() && !scene.box_classes.empty(), ConfigError,
                 "model 'bev': the scene needs BEV classes and box classes");
  BevModelSpec s;
  s.size = cfg.size;
  s.scene = scene;
  s.encoder.backbone = cfg.backbone;
  s.encoder.vit = p.vit;
  // A named ViT (timm's architectures, for pretrained weights: models/vit.h named_vit) keeps its
  // own shape at every size; it pads images to whole patches (a 256 x 704 input with patch 14).
  if (const auto named = named_vit(cfg.backbone)) {
    s.encoder.backbone = "vit";
    s.encoder.vit = *named;
    s.encoder.vit.pad_to_patch = true;
  }
  s.encoder.vit.dropout = cfg.dropout;
  s.encoder.vit.fp32_residual = cfg.fp32_residual;
  s.encoder.vit.fused_kernels = cfg.fused_kernels;
  s.encoder.conv = p.conv;
  s.encoder.image_h = scene.image_height;
  s.encoder.image_w = scene.image_width;
  s.encoder.out_channels = p.bev_channels;
  // Validates the backbone against the image size (throws ConfigError).
  (void)ImageEncoderImpl::analytic_cost(s.encoder);

  const double res = cfg.bev_resolution > 0 ? cfg.bev_resolution : p.bev_resolution;
  const double ex = scene.x_max - scene.x_min, ey = scene.y_max - scene.y_min;
  const int64_t nx = std::max<int64_t>(1, std::llround(ex / res));
  s.query_grid = {scene.x_min, scene.y_min, ex / static_cast<double>(nx), nx,
                  std::max<int64_t>(1, std::llround(ey / (ex / static_cast<double>(nx))))};

  const int64_t z = cfg.bev_heights > 0 ? cfg.bev_heights : p.heights;
  for (int64_t k = 0; k < z; ++k)
    s.heights.push_back(z == 1 ? 1.0 : 2.0 * static_cast<double>(k) / static_cast<double>(z - 1));
  s.bev_channels = p.bev_channels;
  s.head_channels = p.head_channels;
  s.encoder_blocks = p.encoder_blocks;
  s.seg_loss_weight = cfg.seg_loss_weight;
  s.heatmap_loss_weight = cfg.heatmap_loss_weight;
  s.box_loss_weight = cfg.box_loss_weight;
  s.score_threshold = cfg.score_threshold;
  s.max_detections = cfg.max_detections;
  s.velocity = cfg.velocity;
  s.frames = cfg.temporal.frames;
  s.prev_grad = cfg.temporal.prev_grad;
  return s;
}

core::SceneSpec benchmark_scene(const std::string& size) {
  core::SceneSpec s;
  if (size == "tiny") return s;
  (void)size_preset(size);  // validates the name
  s.image_height = 256;
  s.image_width = 704;
  s.x_min = s.y_min = -50;
  s.x_max = s.y_max = 50;
  s.bev_resolution = 0.5;
  return s;
}

// ---- heads ------------------------------------------------------------------------------------

BevHeadsImpl::BevHeadsImpl(int64_t channels, int64_t head_channels, int64_t seg_classes,
                           int64_t box_classes, int64_t nx, int64_t ny, int64_t code_size)
    : channels_(channels),
      head_channels_(head_channels),
      seg_classes_(seg_classes),
      box_classes_(box_classes),
      nx_(nx),
      ny_(ny),
      code_size_(code_size) {
  const ConvNormActOptions o{channels, head_channels, 3, 1, true, nx, ny};
  seg_conv_ = register_module("seg_conv", ConvNormAct(o));
  seg_out_ = register_module("seg_out", units::layer<QuantConv2d>(torch::nn::Conv2dOptions(
                                            head_channels, seg_classes, 1)));
  heat_conv_ = register_module("heat_conv", ConvNormAct(o));
  heat_out_ = register_module("heat_out", units::layer<QuantConv2d>(torch::nn::Conv2dOptions(
                                              head_channels, box_classes, 1)));
  reg_conv_ = register_module("reg_conv", ConvNormAct(o));
  reg_out_ = register_module(
      "reg_out", units::layer<QuantConv2d>(torch::nn::Conv2dOptions(head_channels, code_size, 1)));
  // Prior probability 0.1 (CenterNet).
  units::init_modify(heat_out_->bias, [](at::Tensor& b) { b.fill_(-std::log((1 - 0.1) / 0.1)); });
}

core::TensorDict BevHeadsImpl::forward(const at::Tensor& bev) {
  return {{"seg", seg_out_->forward(seg_conv_->forward(bev))},
          {"heatmap", heat_out_->forward(heat_conv_->forward(bev))},
          {"box_reg", reg_out_->forward(reg_conv_->forward(bev))}};
}

Cost BevHeadsImpl::analytic_cost(int64_t channels, int64_t head_channels, int64_t seg_classes,
                                 int64_t box_classes, int64_t nx, int64_t ny, int64_t code_size) {
  const Cost branch = ConvNormActImpl::analytic_cost({channels, head_channels, 3, 1, true, nx, ny});
  return branch.copies(3) + conv_cost(head_channels, seg_classes, 1, true, nx, ny) +
         conv_cost(head_channels, box_classes, 1, true, nx, ny) +
         conv_cost(head_channels, code_size, 1, true, nx, ny);
}

// ---- model ------------------------------------------------------------------------------------

PerceptionModel::PerceptionModel(const BevModelSpec& spec, LinearFactory linear,
                                 units::TpLayersPtr tp)
    : spec_(spec) {
  spec_.encoder.linear = std::move(linear);
  spec_.encoder.tp = std::move(tp);
  const BevGrid& g = spec_.query_grid;
  const int64_t c = spec_.bev_channels;
  encoder_ = register_module("encoder", ImageEncoder(spec_.encoder));
  view_ = register_module(
      "view", ViewTransformer(ViewTransformerOptions{
                  c, c, spec_.heights, g, spec_.scene.image_height, spec_.scene.image_width,
                  spec_.encoder.vit.fused_kernels, encoder_->span_h(), encoder_->span_w()}));
  if (spec_.frames > 1)
    temporal_ = register_module("temporal", TemporalFusion(c, spec_.frames, g.nx, g.ny));
  for (int64_t i = 0; i < spec_.encoder_blocks; ++i) {
    bev_blocks_.push_back(register_module("bev_block" + std::to_string(i),
                                          std::make_shared<ResidualConvBlock>(c, g.nx, g.ny)));
  }
  heads_ = register_module("heads", BevHeads(c, spec_.head_channels,
                                             static_cast<int64_t>(spec_.scene.bev_classes.size()),
                                             static_cast<int64_t>(spec_.scene.box_classes.size()),
                                             g.nx, g.ny, box_code_size(spec_.velocity)));
  for (const auto& name : spec_.scene.box_classes)
    box_to_bev_class_.push_back(class_index(spec_.scene.bev_classes, name));
}

void PerceptionModel::check_batch(const core::TensorDict& batch) const {
  for (const char* key : {"images", "intrinsics", "cam_to_ego"}) {
    PARALLAX_CHECK(batch.count(key), Error, "model 'bev': batch has no '{}' (docs/data.md)", key);
  }
  const auto& sc = spec_.scene;
  const at::Tensor& im = batch.at("images");
  PARALLAX_CHECK(im.dim() == 5 && im.size(1) == sc.num_cameras && im.size(2) == sc.image_height &&
                     im.size(3) == sc.image_width && im.size(4) == 3,
                 Error, "model 'bev': batch 'images' must be [B, {}, {}, {}, 3], got {}",
                 sc.num_cameras, sc.image_height, sc.image_width, fmt::format("{}", im.sizes()));
  const int64_t b = im.size(0);
  PARALLAX_CHECK(batch.at("intrinsics").sizes() == at::IntArrayRef({b, sc.num_cameras, 3, 3}) &&
                     batch.at("cam_to_ego").sizes() == at::IntArrayRef({b, sc.num_cameras, 4, 4}),
                 Error,
                 "model 'bev': batch 'intrinsics' must be [B, N, 3, 3] and 'cam_to_ego' [B, N, 4, "
                 "4], got {} and {}",
                 fmt::format("{}", batch.at("intrinsics").sizes()),
                 fmt::format("{}", batch.at("cam_to_ego").sizes()));
  if (spec_.frames < 2) return;
  const int64_t f = spec_.frames - 1, n = sc.num_cameras;
  const std::vector<std::pair<const char*, std::vector<int64_t>>> prev = {
      {"prev_images", {b, f, n, sc.image_height, sc.image_width, 3}},
      {"prev_intrinsics", {b, f, n, 3, 3}},
      {"prev_cam_to_ego", {b, f, n, 4, 4}},
      {"prev_to_current", {b, f, 4, 4}}};
  for (const auto& [key, shape] : prev) {
    PARALLAX_CHECK(batch.count(key), Error,
                   "model 'bev' with model.temporal.frames = {}: batch has no '{}' (the previous "
                   "keyframes: set data.frames = {}; docs/data.md)",
                   spec_.frames, key, spec_.frames);
    PARALLAX_CHECK(batch.at(key).sizes() == at::IntArrayRef(shape), Error,
                   "model 'bev': batch '{}' must be [{}], got {}", key, fmt::join(shape, ", "),
                   fmt::format("{}", batch.at(key).sizes()));
  }
}

int PerceptionModel::temporal_unit() const {
  return spec_.frames > 1 ? static_cast<int>(encoder_->num_units() + 1) : -1;
}

at::Tensor PerceptionModel::previous_frames(int unit, const core::TensorDict& batch,
                                            const at::Tensor& x) {
  // BEVDet4D runs the previous frames without gradient: their activations are not kept.
  std::optional<at::NoGradGuard> no_grad;
  if (!spec_.prev_grad) no_grad.emplace();
  const int64_t e = encoder_->num_units();
  if (unit == 0) {
    // [B, F-1, N, H, W, 3] -> [B (F-1) N, 3, H, W], as the current frame's images.
    const at::Tensor images = x.reshape({-1, x.size(3), x.size(4), 3}).permute({0, 3, 1, 2});
    return encoder_->forward_unit(0, normalize_images(images, encoder_->param_dtype()));
  }
  if (unit < e) return encoder_->forward_unit(unit, x);
  // The view transformer, each previous frame with its own cameras: [B (F-1), C, nx, ny].
  const at::Tensor& k = batch.at("prev_intrinsics");
  const at::Tensor& c2e = batch.at("prev_cam_to_ego");
  return view_->forward(x, k.reshape({-1, k.size(2), 3, 3}), c2e.reshape({-1, c2e.size(2), 4, 4}));
}

core::TensorDict PerceptionModel::forward(const core::TensorDict& batch) {
  return forward_chain(batch);
}

int PerceptionModel::chain_length() const {
  return static_cast<int>(encoder_->num_units() + 1 + (spec_.frames > 1 ? 1 : 0) +
                          static_cast<int64_t>(bev_blocks_.size()) + 1);
}

std::vector<double> PerceptionModel::unit_flops() const {
  const std::vector<ModuleCost> c = analytic_cost(spec_);
  const std::vector<Unit> u = units();
  const int64_t e = encoder_->num_units(), nb = static_cast<int64_t>(bev_blocks_.size());
  std::map<std::string, int64_t> numel;
  for (const auto& item : named_parameters()) numel[item.key()] = item.value().numel();
  std::vector<double> enc_params;
  double enc_total = 0;
  for (int64_t i = 0; i < e; ++i) {
    double n = 0;
    for (const auto& name : u[static_cast<std::size_t>(i)].param_names)
      n += static_cast<double>(numel.at(name));
    enc_params.push_back(n);
    enc_total += n;
  }
  std::vector<double> out;
  const std::vector<double> per_image = ImageEncoderImpl::unit_flops(spec_.encoder);
  // Every frame's images go through the encoder and the view transformer (c[0], c[1] count them).
  const double images =
      static_cast<double>(spec_.scene.num_cameras) * static_cast<double>(spec_.frames);
  if (static_cast<int64_t>(per_image.size()) == e) {
    for (double f : per_image) out.push_back(f * images);
  } else {
    for (double n : enc_params)
      out.push_back(c[0].flops * (enc_total > 0 ? n / enc_total : 1.0 / e));
  }
  out.push_back(c[1].flops);
  const std::size_t k = spec_.frames > 1 ? 3 : 2;  // the BEV encoder's component
  if (spec_.frames > 1) out.push_back(c[2].flops);
  for (int64_t i = 0; i < nb; ++i) out.push_back(c[k].flops / static_cast<double>(nb));
  out.push_back(c[k + 1].flops);
  return out;
}

std::vector<at::Tensor> PerceptionModel::chain_begin(const core::TensorDict& batch) {
  check_batch(batch);
  if (spec_.frames > 1) return {batch.at("images"), batch.at("prev_images")};
  return {batch.at("images")};
}

// The units of units(), in order: the image encoder's, the view transformer, each BEV encoder
// block, the heads (three outputs, and the BEV features they read when feature_output_ is set).
std::vector<at::Tensor> PerceptionModel::chain_unit(int unit, const core::TensorDict& batch,
                                                    const std::vector<at::Tensor>& in) {
  const int64_t e = encoder_->num_units();
  const int64_t nb = static_cast<int64_t>(bev_blocks_.size());
  const int64_t t = spec_.frames > 1 ? 1 : 0;  // the temporal unit after the view
  const at::Tensor& x = in.at(0);
  // Frames > 1: the image encoder and the view transformer carry {current, previous}.
  auto with_previous = [&](at::Tensor current) -> std::vector<at::Tensor> {
    if (!t) return {std::move(current)};
    return {std::move(current), previous_frames(unit, batch, in.at(1))};
  };
  if (unit == 0) {
    const int64_t b = x.size(0), n = x.size(1);
    // [B, N, H, W, 3] is NCHW in channels-last layout once the camera dim is folded: no copy.
    const at::Tensor images = x.reshape({b * n, x.size(2), x.size(3), 3}).permute({0, 3, 1, 2});
    return with_previous(
        encoder_->forward_unit(0, normalize_images(images, encoder_->param_dtype())));
  }
  if (unit < e) return with_previous(encoder_->forward_unit(unit, x));
  if (unit == e)
    return with_previous(view_->forward(x, batch.at("intrinsics"), batch.at("cam_to_ego")));
  if (t && unit == e + 1) {
    // Align each previous BEV to the current ego frame, then fuse (models/temporal.h).
    const at::Tensor& poses = batch.at("prev_to_current");
    const at::Tensor aligned =
        align_bev(in.at(1), poses.reshape({-1, 4, 4}).to(x.device()), spec_.query_grid);
    return {temporal_->forward(
        x, aligned.view({x.size(0), spec_.frames - 1, x.size(1), x.size(2), x.size(3)}))};
  }
  if (unit <= e + t + nb)
    return {bev_blocks_[static_cast<std::size_t>(unit - e - t - 1)]->forward(x)};
  PARALLAX_CHECK(unit == e + t + nb + 1, Error, "model 'bev': no unit {} (it has {})", unit,
                 chain_length());
  core::TensorDict heads = heads_->forward(x);
  at::Tensor seg = heads.at("seg");
  const BevGrid lg = spec_.label_grid();
  if (seg.size(2) != lg.nx || seg.size(3) != lg.ny) {
    seg = at::upsample_bilinear2d(seg, {lg.nx, lg.ny}, /*align_corners=*/false);
  }
  std::vector<at::Tensor> out{seg, heads.at("heatmap"), heads.at("box_reg")};
  if (feature_output_) out.push_back(x);
  return out;
}

core::TensorDict PerceptionModel::chain_end(const core::TensorDict&,
                                            const std::vector<at::Tensor>& out) {
  core::TensorDict pred{{"bev_logits", out.at(0)}, {"heatmap", out.at(1)}, {"box_reg", out.at(2)}};
  if (out.size() > 3) pred["bev_features"] = out[3];
  return pred;
}

std::vector<Unit> PerceptionModel::units() const {
  std::vector<UnitPaths> specs = encoder_->unit_paths("encoder");
  specs.push_back({"view", {"view"}});
  if (spec_.frames > 1) specs.push_back({"temporal", {"temporal"}});
  for (std::size_t i = 0; i < bev_blocks_.size(); ++i) {
    const std::string path = "bev_block" + std::to_string(i);
    specs.push_back({path, {path}});
  }
  specs.push_back({"heads", {"heads"}});
  return resolve_units(*this, specs);
}

LossOutput PerceptionModel::loss(const core::TensorDict& batch, const core::TensorDict& pred) {
  for (const char* key : {"bev_semantics", "boxes"}) {
    PARALLAX_CHECK(batch.count(key), Error, "model 'bev': batch has no '{}' (docs/data.md)", key);
  }
  // Counts in the batch (class frequencies, positives, boxes) are means over the data-parallel
  // replicas when the trainer installed them (Model::set_replica_mean), so DDP computes the
  // gradient of one process on the whole batch.
  const ReplicaMean& mean = replica_mean();
  // Segmentation: cross-entropy weighted per class by 1/sqrt(frequency in the batch), so rare
  // classes (objects) are not drowned by background; labels outside [0, classes) are ignored.
  const at::Tensor logits = pred.at("bev_logits").to(at::kFloat);
  const int64_t ns = logits.size(1);
  const at::Tensor labels = batch.at("bev_semantics").to(at::kLong);
  const at::Tensor valid = (labels >= 0) & (labels < ns);
  at::Tensor counts = at::zeros({ns}, logits.options())
                          .index_add_(0, at::where(valid, labels, at::zeros_like(labels)).flatten(),
                                      valid.flatten().to(at::kFloat));
  if (mean) counts = mean(counts);
  const at::Tensor weight = (counts / counts.sum().clamp_min(1)).clamp_min(1e-3).rsqrt();
  // cross_entropy's weighted mean, sum_i w[y_i] l_i / sum_i w[y_i], with the denominator counted
  // over the (replicas') batch: sum_c counts_c w_c. 0 when no cell is labelled.
  const at::Tensor per_cell =
      at::cross_entropy_loss(logits, at::where(valid, labels, at::full_like(labels, -100)), weight,
                             at::Reduction::None, -100);
  const at::Tensor seg = per_cell.sum() / (counts * weight).sum().clamp_min(1e-12);
  // Detection (CenterPoint): targets on the query grid from the padded boxes.
  const DetectionTargets t = encode_detection_targets(
      batch.at("boxes").to(logits.device()), spec_.query_grid,
      static_cast<int64_t>(spec_.scene.box_classes.size()),
      spec_.velocity && batch.count("velocities") ? batch.at("velocities").to(logits.device())
                                                  : at::Tensor());
  const at::Tensor heat = heatmap_focal_loss(pred.at("heatmap"), t.heatmap, mean);
  const at::Tensor reg = box_regression_loss(pred.at("box_reg"), t, mean);
  at::Tensor total =
      spec_.seg_loss_weight * seg + spec_.heatmap_loss_weight * heat + spec_.box_loss_weight * reg;
  return {total,
          {{"seg_ce", seg.detach()}, {"heatmap_focal", heat.detach()}, {"box_l1", reg.detach()}}};
}

double PerceptionModel::forward_flops_per_sample() const {
  double f = 0;
  for (const auto& c : analytic_cost(spec_)) f += c.flops;
  return f;
}

std::vector<std::shared_ptr<torch::nn::Module>> PerceptionModel::recomputable_blocks() {
  std::vector<std::shared_ptr<torch::nn::Module>> out;
  for (const auto& b : encoder_->blocks()) out.push_back(b);
  for (const auto& b : bev_blocks_) out.push_back(b);
  return out;
}

core::TensorDict PerceptionModel::postprocess(const core::TensorDict& pred) {
  Detections d = decode_detections(pred.at("heatmap"), pred.at("box_reg"), spec_.query_grid,
                                   spec_.max_detections, spec_.score_threshold);
  core::TensorDict out{{"bev_labels", pred.at("bev_logits").argmax(1)},
                       {"det_boxes", d.boxes},
                       {"det_scores", d.scores}};
  if (d.velocities.defined()) out.emplace("det_velocities", d.velocities);
  return out;
}

std::vector<ModuleCost> PerceptionModel::analytic_cost(const BevModelSpec& s) {
  const BevGrid& g = s.query_grid;
  const double frames = static_cast<double>(s.frames);
  const Cost backbone = ImageEncoderImpl::analytic_cost(s.encoder).applied(
      static_cast<double>(s.scene.num_cameras) * frames);
  const Cost view =
      ViewTransformerImpl::analytic_cost(
          {s.bev_channels, s.bev_channels, s.heights, g, s.scene.image_height, s.scene.image_width})
          .applied(frames);
  const Cost enc =
      ResidualConvBlock::analytic_cost(s.bev_channels, g.nx, g.ny).copies(s.encoder_blocks);
  const Cost heads = BevHeadsImpl::analytic_cost(
      s.bev_channels, s.head_channels, static_cast<int64_t>(s.scene.bev_classes.size()),
      static_cast<int64_t>(s.scene.box_classes.size()), g.nx, g.ny, box_code_size(s.velocity));
  std::vector<ModuleCost> out{{"backbone", backbone.params, backbone.flops},
                              {"view_transformer", view.params, view.flops}};
  if (s.frames > 1) {
    // Alignment (grid_sample: 4 multiply-adds per channel and cell) and the fusing conv.
    const Cost fuse = TemporalFusionImpl::analytic_cost(s.bev_channels, s.frames, g.nx, g.ny);
    const double align = 8.0 * static_cast<double>(s.bev_channels * g.nx * g.ny) * (frames - 1);
    out.push_back({"temporal", fuse.params, fuse.flops + align});
  }
  out.push_back({"bev_encoder", enc.params, enc.flops});
  out.push_back({"heads", heads.params, heads.flops});
  return out;
}

// ---- example batch ----------------------------------------------------------------------------

core::TensorDict PerceptionModel::example_batch(int64_t n) const {
  const auto& sc = spec_.scene;
  const int64_t cams = sc.num_cameras, kmax = sc.max_boxes;
  const int64_t nbox = static_cast<int64_t>(sc.box_classes.size());
  CameraRig rig = jitter_rig(make_surround_rig({cams, sc.image_height, sc.image_width}), n);
  at::Tensor images = at::randint(0, 256, {n, cams, sc.image_height, sc.image_width, 3}, at::kByte);

  // Boxes: 2-8 per sample, class-typical sizes, kept off the ego vehicle.
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor typical = at::empty({nbox, 3}, f32);
  for (int64_t c = 0; c < nbox; ++c) {
    auto t = typical_size(sc.box_classes[c]);
    for (int d = 0; d < 3; ++d) typical[c][d] = t[d];
  }
  const int64_t hi = std::min<int64_t>(8, kmax), lo = std::min<int64_t>(2, hi);
  at::Tensor count = at::randint(lo, hi + 1, {n}, at::kLong);
  at::Tensor row_valid = at::arange(kmax, at::kLong).unsqueeze(0) < count.unsqueeze(1);  // [n, K]
  at::Tensor cls = at::randint(0, nbox, {n, kmax}, at::kLong);
  at::Tensor dims = typical.index_select(0, cls.flatten()).view({n, kmax, 3}) *
                    (0.85 + 0.3 * at::rand({n, kmax, 3}));
  auto uniform = [&](double a, double b) { return a + (b - a) * at::rand({n, kmax}); };
  at::Tensor x = uniform(sc.x_min + 2, sc.x_max - 2), y = uniform(sc.y_min + 2, sc.y_max - 2);
  at::Tensor near = (x.abs() < 4) & (y.abs() < 4);
  y = at::where(near, (y + 8).clamp_max(sc.y_max - 2), y);
  at::Tensor yaw = uniform(-std::numbers::pi, std::numbers::pi);
  at::Tensor l = dims.select(-1, 0), w = dims.select(-1, 1), h = dims.select(-1, 2);
  at::Tensor z = h / 2;

  // Visibility: fraction of the 8 corners and the centre seen by at least one camera.
  at::Tensor signs = at::tensor({-0.5f, -0.5f, -0.5f, 0.5f,  -0.5f, -0.5f, -0.5f, 0.5f,  -0.5f,
                                 0.5f,  0.5f,  -0.5f, -0.5f, -0.5f, 0.5f,  0.5f,  -0.5f, 0.5f,
                                 -0.5f, 0.5f,  0.5f,  0.5f,  0.5f,  0.5f,  0.0f,  0.0f,  0.0f})
                         .view({9, 3});
  at::Tensor local = signs.view({1, 1, 9, 3}) * dims.unsqueeze(2);  // [n, K, 9, 3]
  at::Tensor c = yaw.cos().unsqueeze(-1), s = yaw.sin().unsqueeze(-1);
  at::Tensor lx = local.select(-1, 0), ly = local.select(-1, 1), lz = local.select(-1, 2);
  at::Tensor pts = at::stack(
      {x.unsqueeze(-1) + c * lx - s * ly, y.unsqueeze(-1) + s * lx + c * ly, z.unsqueeze(-1) + lz},
      -1);
  Projection proj = project_points(pts.view({n, kmax * 9, 3}), rig.intrinsics, rig.cam_to_ego);
  at::Tensor seen =
      visibility_mask(proj, sc.image_height, sc.image_width).any(1).view({n, kmax, 9});
  at::Tensor vis = seen.to(at::kFloat).mean(-1);

  at::Tensor boxes = at::stack({x, y, z, l, w, h, yaw, cls.to(at::kFloat), vis}, -1);
  at::Tensor pad = at::zeros({9}, f32);
  pad[7] = -1;
  boxes = at::where(row_valid.unsqueeze(-1), boxes, pad);

  // BEV semantics on the label grid: a road band along x with dashed markings, boxes on top.
  const BevGrid lg = spec_.label_grid();
  at::Tensor cx = (lg.x_min + (at::arange(lg.nx, f32) + 0.5) * lg.resolution).view({1, -1, 1});
  at::Tensor cy = (lg.y_min + (at::arange(lg.ny, f32) + 0.5) * lg.resolution).view({1, 1, -1});
  at::Tensor sem = at::zeros({n, lg.nx, lg.ny}, at::kLong);
  at::Tensor y0 = (at::rand({n}) * 16 - 8).view({-1, 1, 1});
  const int64_t road = class_index(sc.bev_classes, "road"),
                marking = class_index(sc.bev_classes, "marking");
  if (road >= 0) sem.masked_fill_(((cy - y0).abs() < 4).expand({n, lg.nx, lg.ny}), road);
  if (marking >= 0) {
    at::Tensor dash = at::floor(cx / 3).remainder(2) == 0;
    sem.masked_fill_(((cy - y0).abs() < 0.25) & dash, marking);
  }
  for (int64_t k = 0; k < kmax; ++k) {
    auto v = [&](const at::Tensor& t) { return t.select(1, k).view({-1, 1, 1}); };
    at::Tensor dx = cx - v(x), dy = cy - v(y);
    at::Tensor along = dx * v(yaw).cos() + dy * v(yaw).sin(),
               across = -dx * v(yaw).sin() + dy * v(yaw).cos();
    at::Tensor bev_cls =
        at::tensor(box_to_bev_class_, at::kLong).index_select(0, cls.select(1, k)).view({-1, 1, 1});
    at::Tensor inside =
        (along.abs() <= v(l) / 2) & (across.abs() <= v(w) / 2) & v(row_valid) & (bev_cls >= 0);
    sem = at::where(inside, bev_cls, sem);
  }
  core::TensorDict batch{{"images", images},
                         {"intrinsics", rig.intrinsics},
                         {"cam_to_ego", rig.cam_to_ego},
                         {"bev_semantics", sem},
                         {"boxes", boxes},
                         {"scene_index", at::arange(n, at::kLong)}};
  if (spec_.velocity) {
    // Ground velocities up to 8 m/s per axis, one box in four unknown (NaN, as a converted
    // dataset has them), padding rows unknown.
    const at::Tensor v = (at::rand({n, kmax, 2}) * 16 - 8);
    const at::Tensor known = (at::rand({n, kmax, 1}) >= 0.25) & row_valid.unsqueeze(-1);
    batch.emplace("velocities", at::where(known, v, at::full_like(v, NAN)));
  }
  if (spec_.frames > 1) {
    // The previous keyframes: noise images on the same rig, the ego 0-2 m behind per frame and
    // turned by up to 0.05 rad (a car at up to 4 m/s, keyframes 0.5 s apart).
    const int64_t f = spec_.frames - 1;
    batch.emplace("prev_images",
                  at::randint(0, 256, {n, f, cams, sc.image_height, sc.image_width, 3}, at::kByte));
    batch.emplace("prev_intrinsics",
                  rig.intrinsics.unsqueeze(1).expand({n, f, cams, 3, 3}).clone());
    batch.emplace("prev_cam_to_ego",
                  rig.cam_to_ego.unsqueeze(1).expand({n, f, cams, 4, 4}).clone());
    const at::Tensor k = at::arange(1, f + 1, f32).view({1, f});
    const at::Tensor yaw = (at::rand({n, 1}) * 0.1 - 0.05) * k;
    at::Tensor pose = at::eye(4, f32).expand({n, f, 4, 4}).clone();
    pose.select(-1, 0).select(-1, 0).copy_(yaw.cos());
    pose.select(-1, 1).select(-1, 0).copy_(-yaw.sin());
    pose.select(-1, 0).select(-1, 1).copy_(yaw.sin());
    pose.select(-1, 1).select(-1, 1).copy_(yaw.cos());
    pose.select(-1, 3).select(-1, 0).copy_(-(at::rand({n, 1}) * 2) * k);
    batch.emplace("prev_to_current", pose);
  }
  return batch;
}

}  // namespace parallax::models
