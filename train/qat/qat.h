// Quantization-aware training and post-training quantization (`qat` config section,
// docs/trainers.md "QAT"): symmetric INT8 fake quantization (models/quant.h) on the input (per
// tensor) and weight (per output channel) of every linear layer (models::DenseLinear) and
// convolution (models::QuantConv2d), and on the two inputs of every residual Add
// (models::ResidualConvBlock and models::Bottleneck, one shared per-tensor quantizer), of the model
// but those `qat.skip` names, calibrated over `qat.calib_batches` training batches before the first
// step. Built on the Trainer's extension points (train/trainer.h): a model transform (the
// quantizers), prepare (the calibration) and extra checkpoint entries.
//
// A run: the model is built and its fp32 weights loaded (train.load_from, required), the
// quantizers added (weights' amax: the per-channel max of |W| at that point, frozen), then, after
// the engine and the data are set up, the activations are calibrated: in eval mode, under no-grad,
// with every quantizer passing its input through, pass 1 takes each input's max |x| (max over the
// data-parallel group), and for the percentile and mse calibrators pass 2 builds a histogram of
// |x| over [0, that max] on the same batches (summed over the group); every rank then computes the
// same amax from the same numbers. All quantizers then quantize with frozen amax. Mode qat trains
// as usual (the straight-through estimator carries the gradients); mode ptq takes no optimizer
// step: it evaluates and saves the calibrated model at step 0. Checkpoints hold the amax buffers
// with the weights; a resume loads them and does not calibrate again. A preemption signal during
// the calibration stops it before the next batch on every rank (PreemptionVote over the group):
// calibrate() throws train::PreemptedError, and the trainer exits kExitPreempted with nothing
// saved (nothing was trained; the run starts again from train.load_from).
//
// With qat.attention the inputs of every ViT attention's two matmuls are quantized too (q, k, v
// and the softmax output, one per-tensor quantizer each: models::AttentionImpl).
//
// Limits: tensor and pipeline parallelism (parallel.tp > 1, parallel.pp > 1) are refused; LoRA
// and distillation do not combine with QAT in this version. `parallax export` writes the
// Q/DQ ONNX graph (export_hooks()).
//
// The parts, one concern each (train/qat/): qat_config.h the config section; transform.cpp the
// quantizers (apply(), layers(), set_state()); calibration.cpp calibrate(), hardest(), calib_pool()
// and amax_fingerprint(); sweep.cpp the per-unit evaluations (sensitivity_report(), sweep());
// export_hooks.cpp the Q/DQ export (export_hooks(), activation_qdq()); hooks.cpp the trainer's
// hooks (hooks()) and parse_qat_mode().
#pragma once

#include "models/model.h"
#include "models/quant.h"
#include "train/qat/qat_config.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace parallax::train {

struct RunConfig;
struct TrainerHooks;
class Extension;
struct TrainingStart;

// qat.mode, parsed once: qat fine-tunes (optimizer steps), ptq calibrates only.
enum class QatMode { kQat, kPtq };
// ConfigError naming qat.mode for an unknown name.
QatMode parse_qat_mode(const std::string& name);

namespace qat {

// A quantized layer: its module path and its quantizers. A Linear or Conv has `input` (per tensor)
// and `weight` (per output channel); a residual Add (models::ResidualConvBlock, models::Bottleneck)
// has only `input`, the quantizer its two summands share (`weight` null); an attention matmul input
// (qat.attention, models::AttentionImpl) has only `input`, and its path is the attention's with
// ".q", ".k", ".v" or ".p" appended (the quantizer is the module "<attention>.q_quantizer", ...).
struct Layer {
  enum class Kind { kLinear, kAdd, kAttention };
  std::string path;
  Kind kind = Kind::kLinear;
  std::shared_ptr<models::TensorQuantizerImpl> input, weight;
  bool is_add() const { return kind == Kind::kAdd; }
  // The module path a qat.skip glob names to leave this layer unquantized: the path, or the
  // attention's for an attention input.
  std::string module_path() const;
  // The parameter that places the layer in a unit of Model::units(): its weight; a residual Add's
  // first conv weight; an attention input's qkv weight.
  std::string unit_param() const;
};

// Every layer of `model` with quantizers, in module order.
std::vector<Layer> layers(torch::nn::Module& model);

// Adds quantizers (disabled) to every DenseLinear, QuantConv2d and residual Add
// (ResidualConvBlock, Bottleneck), and with cfg.attention every ViT attention, of `model` but those
// `cfg.skip` names; returns the layers quantized and, in `skipped`, how many were skipped.
// ConfigError naming the key when a skip glob matches no layer (listing some that exist), or when
// no layer is left.
std::vector<Layer> apply(models::Model& model, const QatConfig& cfg, int64_t* skipped = nullptr);

// crc32 of every amax of `layers` (their bytes, in order), as 8 hex digits: what the calibration
// log line prints, so that the ranks of a run can be compared.
std::string amax_fingerprint(const std::vector<Layer>& layers);

// Sets every quantizer of `layers` to `state`.
void set_state(const std::vector<Layer>& layers, models::QuantState state);

// qat.calib_select=hardest: the positions in `losses` (a pool's fp32 losses, in stream order) of
// the `k` highest, highest first; ties go to the earlier batch. ConfigError for a NaN loss (named
// by its position) or k outside [1, losses.size()].
std::vector<int64_t> hardest(const std::vector<double>& losses, int64_t k);

// qat.calib_pool resolved: 20 x calib_batches when 0. ConfigError naming the keys when a pool
// smaller than calib_batches is set.
int64_t calib_pool(const QatConfig& cfg);

// Calibrates the activation quantizers over `cfg.calib_batches` batches of `start` (see the file
// comment; collective over start.dp) and leaves every quantizer quantizing. With
// cfg.calib_select=hardest it first draws calib_pool(cfg) batches, scores each by the model's fp32
// loss (eval mode, no grad, every quantizer off) and calibrates on the calib_batches highest
// (hardest() above; each rank from its own stream), holding at most calib_batches + 1 batches.
// Throws train::PreemptedError on every rank alike when a preemption signal arrived
// (train/preemption.h). Returns the statistics logged: calib_quantizers, calib_layers,
// calib_amax_min, calib_amax_max, calib_amax_mean (over the input quantizers),
// calib_weight_amax_max, calib_unseen (layers whose input the forward never reached: amax 0, they
// quantize everything to 0), calib_s; with hardest also calib_pool, calib_pool_loss_mean and
// calib_loss_min (the lowest loss calibrated on).
std::map<std::string, double> calibrate(const std::vector<Layer>& layers, const QatConfig& cfg,
                                        const TrainingStart& start);

// The sensitivity report: with every quantizer calibrated, evaluates the model (start.evaluate)
// in fp32 (all quantizers off), fully quantized, and with only the layers of one unit of
// model.units() quantized, unit by unit; writes <start.report_dir>/sensitivity.json (rank 0) with
// each evaluation's metrics and, per unit, the drop of every metric against fp32 (fp32 - value);
// logs the units by their miou drop. Leaves every quantizer quantizing. Collective over start.dp.
// Returns the number of evaluations run.
int64_t sensitivity_report(models::Model& model, const std::vector<Layer>& layers,
                           const TrainingStart& start);

// The automated mixed-precision sweep (qat.budget > 0, qat.mode=ptq; docs/trainers.md): with
// every quantizer calibrated, evaluates fp32 and all-INT8; if INT8 loses more than cfg.budget
// points (the metric x 100) of cfg.budget_metric, evaluates each unit of model.units() quantized
// alone, then leaves units unquantized, the most sensitive first (ties in unit order), one more
// per evaluation, until INT8 is within the budget (at least one unit stays INT8). Writes
// <start.report_dir>/quantize_sweep.json (rank 0): every evaluation and step, and `skip`, the
// module paths of the layers left unquantized, which qat.skip takes. A calibrated quantizer passes
// its input through when disabled and its amax does not depend on the others (calibration runs
// with every quantizer passing through), so a PTQ run with qat.skip = skip computes the chosen
// step's evaluation. Leaves every quantizer quantizing. When no step meets the budget: the report,
// then a ConfigError naming qat.budget. Collective over start.dp.
struct SweepResult {
  bool met = false;
  std::vector<std::string> skip;  // layer paths left unquantized
  std::vector<std::string> fp16_units;
  double fp32 = 0, chosen = 0;  // the metric
  int64_t int8_layers = 0, layers = 0;
  double int8_weight_fraction = 0;  // weight elements of the quantized layers / all layers'
  int64_t evals = 0;
};
SweepResult sweep(models::Model& model, const std::vector<Layer>& layers, const QatConfig& cfg,
                  const TrainingStart& start);

// The ONNX export of a quantized model (docs/export.md, "QAT models"): emitter hooks that put
// QuantizeLinear -> DequantizeLinear (int8, zero point 0, scale = max(amax, kMinAmax) / 127) on
// the input of every Linear and Conv layer with quantizers (one scale per tensor), on its weight
// (one scale per output channel, axis 0), and on both inputs of every quantized residual Add (one
// shared scale), where TensorRT fuses them into INT8 kernels. The
// layers must be quantizing (frozen amax). The hooks keep pointers to the quantizers.
std::unique_ptr<models::onnx::EmitHooks> export_hooks(const std::vector<Layer>& layers);

// The activation QuantizeLinear nodes that hooks made by export_hooks() wrote, one entry per
// activation quantizer (a layer's input, a residual Add's shared one), in emission order: the
// graph tensor names of their outputs, in the order the forward calls the quantizer (a Linear or
// Conv input: one; a residual Add: the conv branch's, then the skip's). Empty before the emit.
// Error for hooks of another kind.
struct ActivationQdq {
  std::string layer;
  std::shared_ptr<models::TensorQuantizerImpl> quantizer;
  std::vector<std::string> outputs;
};
std::vector<ActivationQdq> activation_qdq(const models::onnx::EmitHooks& hooks);

// The Trainer's hooks for a QAT run of `cfg` (cfg.qat.enabled). ConfigError without
// train.load_from. The hooks keep a pointer to `cfg`, which must outlive the Trainer.
TrainerHooks hooks(const RunConfig& cfg);
// The `qat` section of `cfg` (train/config_sections.h).
const QatConfig& config(const RunConfig& cfg);
QatConfig& config(RunConfig& cfg);
// QAT as a trainer extension (train/extension.h; registered in train/extensions.cpp).
const Extension& extension();

}  // namespace qat
}  // namespace parallax::train
