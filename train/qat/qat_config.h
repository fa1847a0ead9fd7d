// The `qat` config section (docs/configs.md, docs/trainers.md "QAT"): what a QAT or PTQ run
// quantizes and how it calibrates. Apart from the trainer (qat.h) so that the run config
// (train/run_config.h) and every config reader see the section without compiling the trainer.
#pragma once

#include "core/config.h"

#include <cstdint>
#include <string>
#include <vector>

namespace parallax::train {

struct QatConfig {
  bool enabled = false;
  std::string mode = "qat";
  std::string calibrator = "max";
  double percentile = 99.99;
  int64_t calib_batches = 8;
  std::string calib_select = "first";
  int64_t calib_pool = 0;
  std::vector<std::string> skip;
  bool attention = false;
  bool learn_scales = false;
  bool sensitivity = false;
  double budget = 0;
  std::string budget_metric = "map";

  template <class V>
  void visit(V& v) {
    v("enabled", enabled, "INT8 fake quantization of every linear and conv layer (QAT / PTQ)");
    v("mode", mode,
      "ptq: calibrate, evaluate and save at step 0 (no optimizer step; train.steps ignored); qat: "
      "calibrate, then fine-tune for train.steps (both start from train.load_from)",
      core::Check::one_of({"ptq", "qat"}));
    v("calibrator", calibrator,
      "how activation amax is chosen: max of |x|, a percentile of |x|, or the MSE-optimal clip of "
      "the |x| histogram (weights always use their per-channel max)",
      core::Check::one_of({"max", "percentile", "mse"}));
    v("percentile", percentile, "percentile of |x| kept unclipped by the percentile calibrator",
      core::Check::between(50, 100));
    v("calib_batches", calib_batches, "training batches per rank the calibration runs over",
      core::Check::at_least(1));
    v("calib_select", calib_select,
      "which batches calibrate: first = the first calib_batches of the training stream; hardest "
      "= the calib_batches with the highest fp32 loss among the first calib_pool",
      core::Check::one_of({"first", "hardest"}));
    v("calib_pool", calib_pool,
      "calib_select=hardest: training batches per rank scored by their fp32 loss (0: 20 x "
      "calib_batches, so the hardest 5% calibrate)",
      core::Check::at_least(0));
    v("skip", skip,
      "module-path globs of layers left unquantized (a glob also matches a layer inside a module "
      "it names, e.g. 'heads' or 'encoder.conv.0'); each must match at least one layer");
    v("attention", attention,
      "also quantize the inputs of every ViT attention's two matmuls (q, k, v and the softmax "
      "output, per tensor), as TensorRT's INT8 attention reads them; a skip glob naming the "
      "attention (e.g. '*.attn') leaves them unquantized with its qkv and proj");
    v("learn_scales", learn_scales,
      "qat.mode=qat: train every quantizer's amax (activations and weights) with the weights, by "
      "LSQ's gradient (learned step size), starting from the calibration");
    v("sensitivity", sensitivity,
      "after calibration, evaluate with one model unit quantized at a time and write the drop of "
      "each eval metric to <run>/sensitivity.json (needs a dataset)");
    v("budget", budget,
      "qat.mode=ptq: the automated mixed-precision sweep (0: off): keep the most sensitive units "
      "unquantized, greedily, until INT8 is within this many points (x 100) of fp32's "
      "budget_metric; writes <run>/quantize_sweep.json (parallax quantize runs it)",
      core::Check::at_least(0));
    v("budget_metric", budget_metric, "the eval metric the sweep's budget is on",
      core::Check::one_of({"map", "miou", "nds"}));
  }
};

}  // namespace parallax::train
