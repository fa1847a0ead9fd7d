// The QAT trainer (qat.h, hooks()): the TrainerHooks a QAT or PTQ run adds to the plain trainer
// (the config checks, the model transform, the calibration with its reports in prepare, the
// checkpoint entries), and qat.mode's parser.
#include "train/qat/qat.h"

#include "checkpoint/reader.h"
#include "checkpoint/save_state.h"
#include "core/enum_names.h"
#include "core/error.h"
#include "core/log.h"
#include "models/quant.h"
#include "train/run_config.h"
#include "train/trainer_hooks.h"
#include "units/param_init.h"

#include <fmt/format.h>

#include <map>
#include <memory>

namespace parallax::train {

namespace {
constexpr core::EnumName<QatMode> kQatModes[] = {{QatMode::kQat, "qat"}, {QatMode::kPtq, "ptq"}};
}  // namespace

QatMode parse_qat_mode(const std::string& name) {
  return core::parse_enum(kQatModes, name, "qat.mode", "mode");
}

}  // namespace parallax::train

namespace parallax::train::qat {

using models::QuantState;

namespace {

// What a QAT run keeps between its hooks: the layers the transform quantized.
struct State {
  const RunConfig* cfg = nullptr;
  std::vector<Layer> layers;
};

}  // namespace

TrainerHooks hooks(const RunConfig& cfg) {
  PARALLAX_CHECK(!cfg.train.load_from.empty(), ConfigError,
                 "key 'train.load_from': qat.mode={} quantizes a trained fp32 model; set "
                 "train.load_from to its checkpoint, run directory or weights.h5",
                 qat::config(cfg).mode);
  PARALLAX_CHECK(!qat::config(cfg).sensitivity || !uses_synthetic_data(cfg), ConfigError,
                 "key 'qat.sensitivity': the report compares evaluations, which need a dataset; "
                 "set data.path (and data.synthetic=false) or qat.sensitivity=false");
  PARALLAX_CHECK(qat::config(cfg).budget == 0 || !uses_synthetic_data(cfg), ConfigError,
                 "key 'qat.budget': the sweep compares evaluations, which need a dataset; set "
                 "data.path (and data.synthetic=false) or qat.budget=0");
  PARALLAX_CHECK(
      qat::config(cfg).budget == 0 || parse_qat_mode(qat::config(cfg).mode) == QatMode::kPtq,
      ConfigError,
      "key 'qat.budget': the sweep chooses which layers a PTQ model quantizes; set "
      "qat.mode=ptq (then fine-tune the chosen configuration with qat.mode=qat and "
      "qat.skip from its quantize_sweep.json)");
  PARALLAX_CHECK(
      !qat::config(cfg).learn_scales || parse_qat_mode(qat::config(cfg).mode) == QatMode::kQat,
      ConfigError,
      "key 'qat.learn_scales': scales are learned by training; set qat.mode=qat (PTQ "
      "takes no step)");
  if (qat::config(cfg).calib_select == "hardest")
    (void)calib_pool(qat::config(cfg));  // a bad pool: now, not later
  auto state = std::make_shared<State>();
  state->cfg = &cfg;
  TrainerHooks h;
  h.trains = parse_qat_mode(qat::config(cfg).mode) == QatMode::kQat;
  h.transform_defers = true;
  h.transform_model = [state](models::Model& m) {
    const QatConfig& c = qat::config(*state->cfg);
    int64_t skipped = 0;
    state->layers = apply(m, c, &skipped);
    if (units::DeferredInit* d = units::deferred_init()) {
      // Built without storage (parallel.meta_init under ZeRO-3): each weight quantizer's amax is
      // computed from its weight's recipe (pretrained weights included) when the engine
      // materialises it, as the full build computes it from the weight when quantizers are added.
      d->bind(m);
      for (const auto& l : state->layers) {
        if (!l.weight) continue;
        d->replace(l.path + ".weight_quantizer.amax", [d, weight = l.path + ".weight"] {
          return models::weight_amax(d->value(weight));
        });
      }
    }
    core::log::info(
        "QAT ({}): INT8 fake quantization on {} layers ({} skipped by qat.skip); "
        "calibrator {}{}{}",
        c.mode, state->layers.size(), skipped, c.calibrator,
        c.calibrator == "percentile" ? fmt::format(" ({})", c.percentile) : "",
        c.learn_scales ? "; scales learned (LSQ) from the calibration on" : "");
  };
  h.prepare = [state](const TrainingStart& start) {
    const QatConfig& c = qat::config(*state->cfg);
    if (start.resumed) {
      // The checkpoint held every amax: quantize with them, calibrate nothing.
      set_state(state->layers, QuantState::kQuantizing);
      core::log::info("QAT: resumed; amax from the checkpoint, no calibration");
      return std::map<std::string, double>{};
    }
    auto m = calibrate(state->layers, c, start);
    if (c.sensitivity) {
      m["sensitivity_evals"] =
          static_cast<double>(sensitivity_report(start.model, state->layers, start));
    }
    if (c.budget > 0) {
      const SweepResult r = sweep(start.model, state->layers, c, start);
      m["sweep_evals"] = static_cast<double>(r.evals);
      m["sweep_int8_layers"] = static_cast<double>(r.int8_layers);
      m["sweep_int8_weight_fraction"] = r.int8_weight_fraction;
      m["sweep_" + c.budget_metric] = r.chosen;
      m["sweep_fp32_" + c.budget_metric] = r.fp32;
    }
    core::log::info(
        "QAT: calibrated {} quantizers over {} batch(es) per rank in {:.2f} s: activation amax in "
        "[{:.4g}, {:.4g}] (mean {:.4g}), weight amax up to {:.4g}; amax fingerprint {}{}",
        m["calib_quantizers"], c.calib_batches, m["calib_s"], m["calib_amax_min"],
        m["calib_amax_max"], m["calib_amax_mean"], m["calib_weight_amax_max"],
        amax_fingerprint(state->layers),
        m["calib_unseen"] > 0
            ? fmt::format("; {} layer(s) never reached by the forward", m["calib_unseen"])
            : "");
    return m;
  };
  h.save_extra = [state](checkpoint::SaveState& s) {
    s.set_extra("qat.mode", qat::config(*state->cfg).mode);
    s.set_extra("qat.calibrator", qat::config(*state->cfg).calibrator);
  };
  h.load_extra = [state](checkpoint::CheckpointReader& r) {
    PARALLAX_CHECK(r.metadata().has_extra("qat.calibrator"), CheckpointError,
                   "checkpoint '{}' holds no QAT amax (saved without qat.enabled); start a QAT "
                   "run from its weights with train.load_from={} instead of resuming it",
                   r.dir(), r.dir());
  };
  return h;
}

}  // namespace parallax::train::qat
