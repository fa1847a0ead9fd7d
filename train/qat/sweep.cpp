// Per-unit sensitivity (qat.h): the sensitivity report (qat.sensitivity) and the automated
// mixed-precision sweep behind `parallax quantize` (qat.budget). Both evaluate the calibrated model
// with the quantizers of one unit of Model::units() on or off at a time, so they share how layers
// map to units and how metrics are written.
#include "train/qat/qat.h"

#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/strings.h"
#include "train/trainer_hooks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>

namespace parallax::train::qat {

using models::QuantState;

namespace {

std::string json_metrics(const std::map<std::string, double>& m) {
  std::vector<std::string> items;
  for (const auto& [k, v] : m) {
    if (k == "eval_s") continue;  // timing, not a metric
    items.push_back(fmt::format("{}: {}", core::json_quote(k), core::json_number(v)));
  }
  return "{" + core::join(items, ", ") + "}";
}

// Per unit of model.units() with quantized layers: its name and the indices of its layers in `ls`
// (Layer::unit_param() places each: a residual Add in its block's first conv's unit, an attention
// input in its qkv's). The sensitivity report and the sweep measure the same units.
struct UnitLayers {
  std::string unit;
  std::vector<std::size_t> layers;
};
std::vector<UnitLayers> unit_layers(models::Model& model, const std::vector<Layer>& ls) {
  std::vector<UnitLayers> out;
  for (const auto& unit : model.units()) {
    const std::set<std::string> params(unit.param_names.begin(), unit.param_names.end());
    UnitLayers u{unit.name, {}};
    for (std::size_t i = 0; i < ls.size(); ++i) {
      const Layer& l = ls[i];
      if (params.count(l.unit_param())) u.layers.push_back(i);
    }
    if (!u.layers.empty()) out.push_back(std::move(u));
  }
  return out;
}

}  // namespace

int64_t sensitivity_report(models::Model& model, const std::vector<Layer>& ls,
                           const TrainingStart& start) {
  int64_t evals = 0;
  auto run_eval = [&] {
    ++evals;
    return start.evaluate();
  };
  set_state(ls, QuantState::kDisabled);
  const auto fp32 = run_eval();
  set_state(ls, QuantState::kQuantizing);
  const auto all = run_eval();
  struct Row {
    std::string unit;
    int64_t layers = 0;
    std::map<std::string, double> metrics;
  };
  std::vector<Row> rows;
  // Units with nothing quantized are left out (no drop to measure).
  for (const auto& unit : unit_layers(model, ls)) {
    Row row{unit.unit, static_cast<int64_t>(unit.layers.size()), {}};
    set_state(ls, QuantState::kDisabled);
    for (std::size_t i : unit.layers) {
      ls[i].input->set_state(QuantState::kQuantizing);
      if (ls[i].weight) ls[i].weight->set_state(QuantState::kQuantizing);
    }
    row.metrics = run_eval();
    rows.push_back(std::move(row));
  }
  set_state(ls, QuantState::kQuantizing);
  if (start.report_dir.empty()) return evals;
  auto drop = [&](const std::map<std::string, double>& m) {
    std::map<std::string, double> d;
    for (const auto& [k, v] : m) {
      if (k == "eval_s") continue;
      const auto it = fp32.find(k);
      if (it != fp32.end()) d[k] = it->second - v;
    }
    return d;
  };
  std::string json = fmt::format(
      "{{\n  \"fp32\": {},\n  \"quantized\": {},\n  \"quantized_drop\": {},\n  \"units\": [",
      json_metrics(fp32), json_metrics(all), json_metrics(drop(all)));
  for (std::size_t i = 0; i < rows.size(); ++i) {
    json += fmt::format("{}\n    {{\"unit\": {}, \"layers\": {}, \"metrics\": {}, \"drop\": {}}}",
                        i ? "," : "", core::json_quote(rows[i].unit), rows[i].layers,
                        json_metrics(rows[i].metrics), json_metrics(drop(rows[i].metrics)));
  }
  json += "\n  ]\n}\n";
  const std::string path = (std::filesystem::path(start.report_dir) / "sensitivity.json").string();
  core::write_file_atomic(path, json);
  // The units that lose the most mIoU first.
  std::sort(rows.begin(), rows.end(), [&](const Row& a, const Row& b) {
    const auto get = [&](const Row& r) {
      const auto it = r.metrics.find("miou");
      const auto f = fp32.find("miou");
      return it == r.metrics.end() || f == fp32.end() ? 0.0 : f->second - it->second;
    };
    return get(a) > get(b);
  });
  std::vector<std::string> top;
  for (std::size_t i = 0; i < std::min<std::size_t>(3, rows.size()); ++i) {
    const auto it = rows[i].metrics.find("miou");
    const auto f = fp32.find("miou");
    top.push_back(
        fmt::format("{} ({:+.4f})", rows[i].unit,
                    it == rows[i].metrics.end() || f == fp32.end() ? NAN : it->second - f->second));
  }
  core::log::info("QAT sensitivity: {} units evaluated one at a time; largest miou drops: {}; {}",
                  rows.size(), core::join(top, ", "), path);
  return evals;
}

namespace {

// The sweep's metric (cfg.budget_metric `key`) of one evaluation. ConfigError naming
// qat.budget_metric when the evaluation reports no such metric.
double budget_value(const std::map<std::string, double>& m, const std::string& key) {
  const auto it = m.find(key);
  PARALLAX_CHECK(it != m.end(), ConfigError,
                 "key 'qat.budget_metric': the evaluation reports no '{}' (it has {})", key, [&] {
                   std::vector<std::string> k;
                   for (const auto& [name, v] : m) k.push_back(name);
                   return core::join(k, ", ");
                 }());
  return it->second;
}

// The share of the weights a configuration keeps in INT8: weight elements per layer of `ls` (an
// Add has none), the fraction of all of them in the layers not in fp16.
class WeightShare {
 public:
  WeightShare(models::Model& model, const std::vector<Layer>& ls) : elems_(ls.size(), 0) {
    const auto params = model.named_parameters();
    for (std::size_t i = 0; i < ls.size(); ++i) {
      if (!ls[i].weight) continue;
      if (const at::Tensor* w = params.find(ls[i].path + ".weight"))
        elems_[i] = static_cast<double>(w->numel());
    }
    for (double e : elems_) all_ += e;
  }
  // `fp16`: indices into ls of the layers left unquantized.
  double int8(const std::set<std::size_t>& fp16) const {
    double q = 0;
    for (std::size_t i = 0; i < elems_.size(); ++i)
      if (!fp16.count(i)) q += elems_[i];
    return all_ > 0 ? q / all_ : 0.0;
  }

 private:
  std::vector<double> elems_;
  double all_ = 0;
};

// <dir>/quantize_sweep.json (see sweep() in qat.h): the evaluations of fp32 (`fp32`) and all-INT8
// (`all`), the per-unit drops (`units`, JSON objects, empty when all-INT8 met the budget), every
// step (`steps`, JSON objects) and the result `r`.
void write_sweep_report(const std::string& dir, const QatConfig& cfg, const SweepResult& r,
                        const std::map<std::string, double>& fp32,
                        const std::map<std::string, double>& all,
                        const std::vector<std::string>& units,
                        const std::vector<std::string>& steps) {
  const std::string json = fmt::format(
      "{{\n  \"metric\": {},\n  \"budget_points\": {},\n  \"met\": {},\n  \"fp32\": {},\n  "
      "\"quantized\": {},\n  \"units\": [{}],\n  \"steps\": [\n    {}\n  ],\n  \"fp16_units\": "
      "{},\n  \"skip\": {},\n  \"layers\": {},\n  \"int8_layers\": {},\n  "
      "\"int8_weight_fraction\": {},\n  \"chosen\": {}\n}}\n",
      core::json_quote(cfg.budget_metric), core::json_number(cfg.budget), r.met ? "true" : "false",
      json_metrics(fp32), json_metrics(all), core::join(units, ", "), core::join(steps, ",\n    "),
      core::json_strings(r.fp16_units), core::json_strings(r.skip), r.layers, r.int8_layers,
      core::json_number(r.int8_weight_fraction), core::json_number(r.chosen));
  core::write_file_atomic((std::filesystem::path(dir) / "quantize_sweep.json").string(), json);
}

}  // namespace

SweepResult sweep(models::Model& model, const std::vector<Layer>& ls, const QatConfig& cfg,
                  const TrainingStart& start) {
  const std::string& key = cfg.budget_metric;
  SweepResult r;
  auto metric = [&](const std::map<std::string, double>& m) { return budget_value(m, key); };
  // Quantize every layer but those in `fp16` (indices into ls), evaluate.
  auto evaluate = [&](const std::set<std::size_t>& fp16) {
    for (std::size_t i = 0; i < ls.size(); ++i) {
      const QuantState s = fp16.count(i) ? QuantState::kDisabled : QuantState::kQuantizing;
      ls[i].input->set_state(s);
      if (ls[i].weight) ls[i].weight->set_state(s);
    }
    ++r.evals;
    return start.evaluate();
  };
  const WeightShare weights(model, ls);
  const auto fp32 = evaluate([&] {
    std::set<std::size_t> every;
    for (std::size_t i = 0; i < ls.size(); ++i) every.insert(i);
    return every;
  }());
  r.fp32 = metric(fp32);
  const auto all = evaluate({});
  const double budget = cfg.budget / 100;  // points -> the metric's fraction
  const auto units = unit_layers(model, ls);
  struct Ranked {
    std::size_t unit;
    double drop;
  };
  std::vector<Ranked> ranked;
  std::vector<std::string> steps_json;
  std::set<std::size_t> fp16;
  double value = metric(all);
  auto step_json = [&](const std::vector<std::string>& fp16_units, double v) {
    return fmt::format(
        "{{\"fp16_units\": {}, \"{}\": {}, \"drop_points\": {}, \"int8_layers\": {}, "
        "\"int8_weight_fraction\": {}}}",
        core::json_strings(fp16_units), key, core::json_number(v),
        core::json_number((r.fp32 - v) * 100), static_cast<int64_t>(ls.size() - fp16.size()),
        core::json_number(weights.int8(fp16)));
  };
  steps_json.push_back(step_json({}, value));
  std::vector<std::string> unit_json;
  if (r.fp32 - value > budget) {
    // One unit quantized at a time: its drop alone.
    for (std::size_t u = 0; u < units.size(); ++u) {
      std::set<std::size_t> others;
      for (std::size_t i = 0; i < ls.size(); ++i) others.insert(i);
      for (std::size_t i : units[u].layers) others.erase(i);
      ranked.push_back({u, r.fp32 - metric(evaluate(others))});
      unit_json.push_back(fmt::format("{{\"unit\": {}, \"layers\": {}, \"drop_points\": {}}}",
                                      core::json_quote(units[u].unit), units[u].layers.size(),
                                      core::json_number(ranked.back().drop * 100)));
    }
    std::stable_sort(ranked.begin(), ranked.end(),
                     [](const Ranked& a, const Ranked& b) { return a.drop > b.drop; });
    // Greedy: the most sensitive unit unquantized next, until within the budget; at least one
    // unit stays quantized (all of them in fp16 is not an INT8 model).
    for (std::size_t k = 0; k + 1 < ranked.size() && r.fp32 - value > budget; ++k) {
      const UnitLayers& u = units[ranked[k].unit];
      for (std::size_t i : u.layers) fp16.insert(i);
      r.fp16_units.push_back(u.unit);
      value = metric(evaluate(fp16));
      steps_json.push_back(step_json(r.fp16_units, value));
      core::log::info("QAT sweep: {} unquantized ({} layers in fp16): {} {:.4f} ({:+.2f} points)",
                      u.unit, fp16.size(), key, value, (value - r.fp32) * 100);
    }
  }
  r.met = r.fp32 - value <= budget;
  r.chosen = value;
  r.layers = static_cast<int64_t>(ls.size());
  r.int8_layers = static_cast<int64_t>(ls.size() - fp16.size());
  r.int8_weight_fraction = weights.int8(fp16);
  // An attention's four inputs are skipped by its module path (with its qkv and proj, of the same
  // unit and so also in fp16).
  for (std::size_t i : fp16) {
    const std::string p = ls[i].module_path();
    if (std::find(r.skip.begin(), r.skip.end(), p) == r.skip.end()) r.skip.push_back(p);
  }
  set_state(ls, QuantState::kQuantizing);
  if (!start.report_dir.empty())
    write_sweep_report(start.report_dir, cfg, r, fp32, all, unit_json, steps_json);
  core::log::info(
      "QAT sweep ({} within {} points of fp32 {:.4f}): {}; {} of {} layers INT8 ({:.1f}% of the "
      "weights), {} {:.4f}",
      key, cfg.budget, r.fp32, r.met ? "met" : "NOT met", r.int8_layers, r.layers,
      100 * r.int8_weight_fraction, key, value);
  PARALLAX_CHECK(r.met, ConfigError,
                 "key 'qat.budget': no INT8 configuration keeps {} within {} points of fp32's "
                 "{:.4f}: with every unit but the least sensitive in fp16 it is {:.4f} (report: "
                 "quantize_sweep.json in the run directory); raise the budget, calibrate "
                 "differently (qat.calibrator, qat.calib_select) or fine-tune with qat.mode=qat",
                 key, cfg.budget, r.fp32, value);
  return r;
}

}  // namespace parallax::train::qat
