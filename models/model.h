// The interface every model of the zoo implements, and the registry that builds them by name.
//
// A model maps a batch (named tensors from the data layer) to predictions and computes its own
// loss terms, so the trainer stays model-agnostic. Models never call collectives themselves;
// the tensor-parallel layers they borrow through units/tp_layers.h do, and a loss may use the
// replica mean the trainer installs (set_replica_mean). A model also exposes its ordered units
// (Unit, UnitHooks): the grain at which the parallel engines gather and free parameters (ZeRO-3),
// cut pipeline stages, recompute activations and quantise (docs/models.md, "Units").
#pragma once

#include "core/scene.h"
#include "core/tensor_dict.h"
#include "models/layers.h"
#include "models/model_config.h"
#include "models/replica_mean.h"
#include "units/parallel_model.h"
#include "units/tp_layers.h"
#include "units/unit_hooks.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace parallax::models {

// Parameters and forward FLOPs (one sample, multiply-add = 2 FLOPs) of one named component of a
// model at its configured input shape, e.g. {"backbone", 21.7e6, 5.1e9}.
struct ModuleCost {
  std::string name;
  int64_t params = 0;
  double flops = 0;
};

// One unit: a contiguous piece of the forward that owns a disjoint set of parameters (defined in
// units/unit_hooks.h, so that the parallel engines take unit lists without including models/).
using Unit = units::Unit;

// The hooks a model calls around each unit's forward (units/unit_hooks.h: they live below models/
// so that the parallel engines, which may not include models/, implement them).
using UnitHooks = units::UnitHooks;

// A unit named by module paths: it owns every parameter whose full name is one of `paths` or
// lies under one of them (path + "."). Paths rather than a list of names, so parameters added
// inside a module later (LoRA adapters, QAT scales) join their module's unit.
struct UnitPaths {
  std::string name;
  std::vector<std::string> paths;
};

// Training-only modules a trainer adds to a model (distillation's feature projection) are
// registered under this name ("aux.<module>"): their parameters train and are checkpointed with the
// model's, join its last unit, and are never exported (weights.h5, ONNX), nor expected by a model
// that loads the checkpoint without them.
inline constexpr const char* kAuxModule = "aux";

// The units `specs` describe, with the parameter names of `module.named_parameters()` in
// registration order (parameters under kAuxModule join the last unit). Throws parallax::Error
// naming the parameter or unit when a parameter lies in no unit or in two, or a unit owns no
// parameter: a unit list that does not cover the model exactly would make ZeRO-3 skip or
// double-count parameters silently.
std::vector<Unit> resolve_units(const torch::nn::Module& module,
                                const std::vector<UnitPaths>& specs);

// Where a parameter sits in a layered model, for layer-wise learning-rate decay (optim.layer_decay,
// BEiT/MAE fine-tuning): layer `id` of a model with `depth` blocks, 0 for the embedding (patch
// embedding, position embedding, class and register tokens), i + 1 for block i, depth + 1 for
// everything after the last block (the final norm, necks, heads). Model::layer_depth answers it.
struct LayerDepth {
  int id = 0;
  int depth = 0;
};

// The layer of `name` in a ViT registered at `vit_prefix` ("encoder.vit." or "vit.") with `depth`
// blocks: `<prefix>block<i>.*` is block i, `<prefix>norm.*` comes after the last block, every other
// `<prefix>*` (patch_embed, pos_embed, cls_token, reg_token, ...) is the embedding, and a name
// outside the ViT comes after the last block.
LayerDepth vit_layer_depth(const std::string& name, const std::string& vit_prefix, int depth);

struct LossOutput {
  at::Tensor total;        // scalar, what backward() runs on
  core::TensorDict terms;  // each named term (detached or not), for metrics
};

// The planner's activation model (units/parallel_model.h: the parallel engines read it too).
using ActivationQuery = units::ActivationQuery;
struct UnitActivation {
  struct InnerBlock;
  // Not an aggregate, so that {saved, output, recomputable} leaves `inner` empty without a warning.
  UnitActivation(double saved_bytes = 0, double output_bytes = 0, bool is_block = false)
      : saved(saved_bytes), output(output_bytes), recomputable(is_block) {}

  double saved = 0;           // bytes per sample kept from this unit's forward to its backward
  double output = 0;          // bytes per sample of the unit's outputs (a pipeline message)
  bool recomputable = false;  // one of recomputable_blocks(): recomputed under Recompute
  // A unit that is not one block but holds several of recomputable_blocks() (a ResNet stage's
  // bottlenecks), in forward order: the bytes each keeps (part of `saved`) and its input's, which
  // is all it keeps once wrapped.
  struct InnerBlock {
    double saved = 0, input = 0;
  };
  std::vector<InnerBlock> inner;
};

// Activation recompute (units/parallel_model.h; the config's train.activation_checkpointing): the
// mode, and which blocks it wraps.
using units::Recompute;
using units::recomputed_block;

// A model is a module and a units::ParallelModel: what parallel::parallelize() composes the
// parallelisms over (units, the chain, costs, activation recompute, unit hooks).
class VisionTransformerImpl;

// A model's image backbone: its module path with a trailing dot ("encoder.vit."), its kind
// ("vit", "resnet", "conv") and, for a ViT, the ViT (its geometry: grid, prefix tokens, patch).
struct BackboneSite {
  std::string path;
  std::string kind;
  const VisionTransformerImpl* vit = nullptr;
};

class Model : public torch::nn::Module, public units::ParallelModel {
 public:
  std::shared_ptr<torch::nn::Module> as_module() override { return shared_from_this(); }
  // Predictions for a batch (keys are model-specific, e.g. "bev_logits", "heatmap").
  virtual core::TensorDict forward(const core::TensorDict& batch) = 0;
  // Loss terms and their weighted total for `batch` given `pred` from forward().
  virtual LossOutput loss(const core::TensorDict& batch, const core::TensorDict& pred) = 0;
  // Forward FLOPs for one sample (multiply-add = 2 FLOPs); used for MFU (training ~ 3x forward).
  virtual double forward_flops_per_sample() const = 0;
  // Blocks that activation recompute may wrap (transformer blocks); empty if none.
  virtual std::vector<std::shared_ptr<torch::nn::Module>> recomputable_blocks() { return {}; }
  // Decoded outputs for evaluation and export (e.g. "bev_labels" [B, X, Y] int64, "det_boxes"
  // [B, K, 9] and "det_scores" [B, K]); the default returns `pred` unchanged.
  virtual core::TensorDict postprocess(const core::TensorDict& pred) { return pred; }
  // Samples in a batch (the leading dimension of the model's main input).
  virtual int64_t batch_size(const core::TensorDict& batch) const = 0;
  // A random batch of `n` samples with the shapes and dtypes the model expects (benchmark mode
  // and tests), drawn from the default CPU generator.
  virtual core::TensorDict example_batch(int64_t n) const = 0;

  // Parameters and forward FLOPs per component (sums to parameter_count() and
  // forward_flops_per_sample()); empty if the model does not break its cost down.
  virtual std::vector<ModuleCost> cost_breakdown() const { return {}; }

  // Writes the forward as ONNX nodes (models/onnx/emitter.h). The default walks the model unit by
  // unit, as the forward runs them: emit_onnx_inputs() declares the graph inputs (the batch keys
  // forward() reads) and returns what unit 0 takes; emit_onnx_unit(i) writes the layers of unit i
  // (each layer emits its own nodes) from the values the unit before it returned, and returns its
  // own; emit_onnx_outputs() declares one graph output per key of forward()'s result from the last
  // unit's values. A model may instead override emit_onnx() whole. The defaults throw
  // parallax::Error: the model has no ONNX emitter.
  virtual void emit_onnx(onnx::Emitter& e);
  // What flows through the walk: the values the last unit returned, and the graph inputs by name
  // (side inputs such as the camera geometry, which a later unit reads).
  struct OnnxFlow {
    std::vector<onnx::Value> values;
    std::map<std::string, onnx::Value> inputs;
  };
  virtual OnnxFlow emit_onnx_inputs(onnx::Emitter& e);
  virtual std::vector<onnx::Value> emit_onnx_unit(onnx::Emitter& e, int unit, const OnnxFlow& flow);
  virtual void emit_onnx_outputs(onnx::Emitter& e, const OnnxFlow& flow);

  // The forward as a chain of its units, for pipeline stages (the pipeline engine), which run a
  // contiguous run of units on each rank and pass the tensors between them point-to-point:
  //   chain_begin(batch)            checks the batch; what unit 0 takes (e.g. {images})
  //   chain_unit(i, batch, in)      unit i on what unit i - 1 returned; side inputs (the camera
  //                                 geometry) come from `batch`, which a later stage receives
  //                                 without "images"
  //   chain_end(batch, out)         forward()'s predictions from the last unit's outputs
  // A model that implements them runs forward() as forward_chain(), so a pipeline computes the
  // same function as one process. chain_length() is the number of units (0: the model cannot be
  // pipelined; the defaults throw parallax::Error naming it).
  int chain_length() const override { return 0; }
  // Forward FLOPs per sample of each unit, in chain order (what pipeline stages are balanced by);
  // empty: not broken down (the pipeline then balances by parameters).
  virtual std::vector<double> unit_flops() const { return {}; }
  // What pipeline stages are balanced by, one value per unit: unit_flops(), or where the model
  // does not break its FLOPs down, each unit's parameter count + 1 (so a unit without many still
  // counts). The trainer partitions by it, and `parallax plan` predicts that partition.
  std::vector<double> stage_costs() const override;
  // Activation bytes per sample of each unit, in chain order (empty: the model has no
  // activation model; the planner then cannot estimate it). See ActivationQuery.
  virtual std::vector<UnitActivation> unit_activations(const ActivationQuery&) const { return {}; }
  // Bytes per sample each unit keeps from its forward to its backward under activation recompute
  // `mode` (train.activation_checkpointing: none | selective | full, wrapped as
  // recomputed_block() says): a wrapped block keeps only its input. Empty where the model has no
  // activation model. `recomputed`, if given, receives which units are recomputed (a unit of
  // UnitActivation::inner blocks: when any of them is). The pipeline
  // partition (second criterion) and `parallax plan` both use it.
  std::vector<double> saved_activations(const ActivationQuery& q, Recompute mode,
                                        std::vector<bool>* recomputed = nullptr) const override;
  // Wraps recomputable_blocks() as recomputed_block(mode, i) says; returns {wrapped, blocks}.
  std::pair<int, int> apply_recompute(Recompute mode) override;
  virtual std::vector<at::Tensor> chain_begin(const core::TensorDict& batch);
  virtual std::vector<at::Tensor> chain_unit(int unit, const core::TensorDict& batch,
                                             const std::vector<at::Tensor>& in);
  virtual core::TensorDict chain_end(const core::TensorDict& batch,
                                     const std::vector<at::Tensor>& out);
  // Units [first, last) of the chain through run_unit (hooks called), on `in`.
  std::vector<at::Tensor> run_chain(int first, int last, const core::TensorDict& batch,
                                    std::vector<at::Tensor> in);

  // Why a training step of this model cannot be captured into a CUDA graph (train.cuda_graph):
  // a forward or loss that reads device values on the host, or whose shapes depend on the data.
  // Empty: capturable.
  virtual std::string graph_capture_blocker() const { return {}; }

  // Where the image backbone lies, for pretrained weights (model.pretrained.target=backbone):
  // nullopt for a model without one.
  virtual std::optional<BackboneSite> backbone_site() const { return std::nullopt; }

  int64_t parameter_count() const;

  // The layer of parameter `param_name` (LayerDepth) for layer-wise lr decay; nullopt (the
  // default) where the model has no layers (a conv backbone, the mlp): optim.layer_decay is then
  // refused.
  virtual std::optional<LayerDepth> layer_depth(const std::string& param_name) const {
    (void)param_name;
    return std::nullopt;
  }

  // The ordered units; every parameter of named_parameters() is in exactly one unit. The default
  // (for models that do not override) is a single unit "model" holding every parameter; such a
  // model's forward must run as run_unit(0, ...) for installed hooks to be called.
  std::vector<Unit> units() const override;
  // Installs hooks (nullptr: none, the default). Not owned: `hooks` must outlive its installation.
  void set_unit_hooks(UnitHooks* hooks) override { unit_hooks_ = hooks; }
  UnitHooks* unit_hooks() const { return unit_hooks_; }

  // Loss normalisers that count things in the batch (positive heatmap cells, target boxes,
  // labelled cells per class) must count the whole data-parallel batch, or DDP's average of the
  // replicas' gradients is not the gradient of one process on that batch (MMDetection3D does the
  // same with reduce_mean of avg_factor). The trainer installs the mean over its data-parallel
  // group around each training step, when every replica runs loss() the same number of times;
  // empty (the default, and during evaluation) means this replica alone.
  void set_replica_mean(ReplicaMean mean) { replica_mean_ = std::move(mean); }
  const ReplicaMean& replica_mean() const { return replica_mean_; }

 protected:
  // chain_end(run_chain(0, chain_length(), chain_begin(batch))): forward() of a chainable model.
  core::TensorDict forward_chain(const core::TensorDict& batch) {
    return chain_end(batch, run_chain(0, chain_length(), batch, chain_begin(batch)));
  }

  // Runs `fn` as unit `index`: calls before_unit(index), fn(), after_unit(index, outputs);
  // without hooks it is just fn(). The models' forwards call each unit through it, in unit order.
  std::vector<at::Tensor> run_unit(int index, const std::function<std::vector<at::Tensor>()>& fn);

  // run_unit for a unit with one output tensor. Without hooks (the 1-GPU benchmark path) it is a
  // plain branch to fn(): no std::function and no vector are built.
  template <class Fn>
  at::Tensor run_unit1(int index, Fn&& fn) {
    if (unit_hooks_ == nullptr) return fn();
    at::Tensor out;
    run_unit(index, [&] {
      out = fn();
      return std::vector<at::Tensor>{out};
    });
    return out;
  }

 private:
  ReplicaMean replica_mean_;
  UnitHooks* unit_hooks_ = nullptr;
};

// Makes `name` (auto | cudnn | flash | fa3 | efficient | math) the first fused attention kernel
// that at::scaled_dot_product_attention tries, process-wide (fa3: FlashAttention-3 on Hopper, where
// this LibTorch has it). build_model() applies `cfg.attention`. ConfigError for an unknown name.
void set_attention_backend(const std::string& name);

// Builds a model of the zoo by `cfg.name` and `cfg.size` for data described by `scene`; throws
// ConfigError for unknown names or sizes, or a scene the model cannot take.
std::shared_ptr<Model> build_model(const ModelConfig& cfg, const core::SceneSpec& scene);
// The same, with the linear layers of every attention and MLP block built by `linear` (see
// LinearFactory in models/layers.h). Models without such blocks (mlp) ignore it.
std::shared_ptr<Model> build_model(const ModelConfig& cfg, const core::SceneSpec& scene,
                                   const LinearFactory& linear);
// Tensor parallel over `tp` (units/tp_layers.h, implemented by the tensor-parallel group that the
// caller built; null: build_model(cfg, scene), a group of one rank: the parallel layers with
// trivial collectives): the ViT blocks' linears
// column- and row-parallel (with sequence parallelism when `tp` asks), vit_cls's head
// column-parallel. ConfigError naming the model for one without tensor-parallel layers (mlp, bev
// with the conv backbone), and naming both numbers for shapes tp does not divide (heads, widths,
// classes).
std::shared_ptr<Model> build_model(const ModelConfig& cfg, const core::SceneSpec& scene,
                                   const units::TpLayersPtr& tp);

// The cost_breakdown() that build_model(cfg, scene) would report, computed from the config alone
// without allocating the model (the 3b model has ~3e9 parameters). Same errors as build_model.
std::vector<ModuleCost> analytic_cost(const ModelConfig& cfg, const core::SceneSpec& scene);

}  // namespace parallax::models
