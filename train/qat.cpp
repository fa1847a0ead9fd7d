#include "train/qat.h"

#include "checkpoint/reader.h"
#include "checkpoint/save_state.h"
#include "core/enum_names.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "core/param_init.h"
#include "core/strings.h"
#include "core/timer.h"
#include "models/layers.h"
#include "models/vit.h"
#include "train/lora.h"
#include "train/preemption.h"
#include "train/run_config.h"
#include "train/trainer.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <set>

namespace parallax::train {

namespace {
constexpr core::EnumName<QatMode> kQatModes[] = {{QatMode::kQat, "qat"}, {QatMode::kPtq, "ptq"}};
}  // namespace

QatMode parse_qat_mode(const std::string& name) {
  return core::parse_enum(kQatModes, name, "qat.mode", "mode");
}

}  // namespace parallax::train

namespace parallax::train::qat {

namespace {

using models::CalibPass;
using models::QuantState;

// The quantizable layer at `module`, if it is one: its quantizers (empty before apply()). An
// attention (its four inputs: layers() lists them) only when `attention`.
bool quantizable(torch::nn::Module* module, Layer* out, bool attention) {
  if (auto* a = dynamic_cast<models::AttentionImpl*>(module)) {
    out->kind = Layer::Kind::kAttention;
    out->input = a->quantized() ? a->q_quantizer.ptr() : nullptr;
    out->weight = nullptr;
    return attention || a->quantized();
  }
  if (auto* d = dynamic_cast<models::DenseLinearImpl*>(module)) {
    out->input = d->input_quantizer.is_empty() ? nullptr : d->input_quantizer.ptr();
    out->weight = d->weight_quantizer.is_empty() ? nullptr : d->weight_quantizer.ptr();
    return true;
  }
  if (auto* c = dynamic_cast<models::QuantConv2dImpl*>(module)) {
    out->input = c->input_quantizer.is_empty() ? nullptr : c->input_quantizer.ptr();
    out->weight = c->weight_quantizer.is_empty() ? nullptr : c->weight_quantizer.ptr();
    return true;
  }
  if (auto* r = dynamic_cast<models::ResidualConvBlock*>(module)) {
    out->kind = Layer::Kind::kAdd;
    out->input = r->add_quantizer.is_empty() ? nullptr : r->add_quantizer.ptr();
    out->weight = nullptr;
    return true;
  }
  return false;
}

constexpr const char* kAttentionInputs[] = {"q", "k", "v", "p"};

// Whether `glob` names the layer at `path` or a module containing it (a dotted prefix of it).
bool skip_matches(const std::string& glob, const std::string& path) {
  if (lora::glob_match(glob, path)) return true;
  for (std::size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1)) {
    if (lora::glob_match(glob, path.substr(0, dot))) return true;
  }
  return false;
}

// Every rank's values [n] reduced by `op` over `dp` (null: this process alone), on the device its
// backend takes.
at::Tensor reduce(at::Tensor t, parallel::comm::ReduceOp op, const parallel::comm::CommPtr& dp,
                  c10::Device device) {
  if (!dp || dp->size() <= 1) return t;
  const c10::Device on = dp->device_type() == c10::kCPU ? c10::Device(c10::kCPU) : device;
  at::Tensor x = t.to(on).contiguous();
  dp->all_reduce(x, op);
  return x.to(t.device());
}

// Preemption during the calibration (train/preemption.h): check() before every batch. Under a
// data-parallel group and `parallax train`'s signal handler, every rank contributes to a
// PreemptionVote, so all ranks stop before the same batch (one batch after the signal, the vote's
// lag); alone, the local flag. Every rank calls check() the same number of times (the same
// calib_batches). Stopping throws PreemptedError: the model is left in training mode as found
// (its quantizers calibrating, of no use: nothing is saved, the run starts again from
// train.load_from).
class CalibrationStop {
 public:
  CalibrationStop(const TrainingStart& start, int64_t batches)
      : model_(start.model), was_training_(start.model.is_training()), batches_(batches) {
    if (start.dp && start.dp->size() > 1 && PreemptionSignals::installed())
      vote_.emplace(*start.dp, start.device, kVoteTimeoutS);
  }
  void check(int pass, int64_t batch, int64_t of = -1) {
    const bool stop = vote_ ? vote_->should_stop() : PreemptionSignals::requested();
    if (!stop) return;
    vote_.reset();  // should_stop() returned true: no vote is outstanding
    if (was_training_) model_.train();
    throw PreemptedError(fmt::format(
        "preempted during the QAT calibration (pass {}, before batch {} of {}): nothing was "
        "trained or saved; run the same command again to calibrate from train.load_from",
        pass, batch + 1, of >= 0 ? of : batches_));
  }
  // The vote's last round is waited for (its result is for the trainer's own vote to see).
  void finish() { vote_.reset(); }

 private:
  static constexpr double kVoteTimeoutS = 300;
  models::Model& model_;
  bool was_training_;
  int64_t batches_;
  std::optional<PreemptionVote> vote_;
};

}  // namespace

std::string amax_fingerprint(const std::vector<Layer>& ls) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  for (const auto& l : ls) {
    for (const auto& q : {l.input, l.weight}) {
      if (!q) continue;
      const at::Tensor c = q->amax.detach().to(at::kCPU).contiguous();
      crc = ::crc32(crc, static_cast<const Bytef*>(c.data_ptr()), static_cast<uInt>(c.nbytes()));
    }
  }
  return fmt::format("{:08x}", static_cast<uint32_t>(crc));
}

std::string Layer::module_path() const {
  return kind == Kind::kAttention ? path.substr(0, path.rfind('.')) : path;
}

std::string Layer::unit_param() const {
  switch (kind) {
    case Kind::kAdd:
      return path + ".conv1.conv.weight";
    case Kind::kAttention:
      return module_path() + ".qkv.weight";
    case Kind::kLinear:
      break;
  }
  return path + ".weight";
}

std::vector<Layer> layers(torch::nn::Module& model) {
  std::vector<Layer> out;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    Layer l;
    if (!quantizable(item.value().get(), &l, false) || !l.input) continue;
    l.path = item.key();
    if (l.kind == Layer::Kind::kAttention) {
      // q, k, v, p: the order the forward quantizes them in.
      auto* a = dynamic_cast<models::AttentionImpl*>(item.value().get());
      const models::TensorQuantizer* qs[] = {&a->q_quantizer, &a->k_quantizer, &a->v_quantizer,
                                             &a->p_quantizer};
      for (int i = 0; i < 4; ++i) {
        Layer in = l;
        in.path = l.path + "." + kAttentionInputs[i];
        in.input = qs[i]->ptr();
        out.push_back(std::move(in));
      }
      continue;
    }
    out.push_back(std::move(l));
  }
  return out;
}

std::vector<Layer> apply(models::Model& model, const QatConfig& cfg, int64_t* skipped) {
  std::vector<std::string> all;
  std::vector<int> hits(cfg.skip.size(), 0);
  int64_t n_skipped = 0;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    Layer l;
    if (!quantizable(item.value().get(), &l, cfg.attention)) continue;
    const std::string& path = item.key();
    all.push_back(path);
    bool skip = false;
    for (std::size_t g = 0; g < cfg.skip.size(); ++g) {
      if (!skip_matches(cfg.skip[g], path)) continue;
      ++hits[g];
      skip = true;
    }
    if (skip) {
      ++n_skipped;
      continue;
    }
    if (auto* d = dynamic_cast<models::DenseLinearImpl*>(item.value().get())) {
      d->add_quantizers(cfg.learn_scales);
    } else if (auto* c = dynamic_cast<models::QuantConv2dImpl*>(item.value().get())) {
      c->add_quantizers(cfg.learn_scales);
    } else if (auto* a = dynamic_cast<models::AttentionImpl*>(item.value().get())) {
      a->add_quantizers(cfg.learn_scales);
    } else {
      dynamic_cast<models::ResidualConvBlock*>(item.value().get())
          ->add_quantizers(cfg.learn_scales);
    }
  }
  for (std::size_t g = 0; g < cfg.skip.size(); ++g) {
    if (hits[g] > 0) continue;
    std::vector<std::string> some(all.begin(),
                                  all.begin() + std::min<std::ptrdiff_t>(6, all.size()));
    throw_error<ConfigError>(
        "key 'qat.skip': '{}' matches no quantizable layer of model '{}'{}", cfg.skip[g],
        model.name(),
        all.empty() ? " (it has none)"
                    : fmt::format(" (its linear and conv layers are e.g. {}{})",
                                  core::join(some, ", "), all.size() > some.size() ? ", ..." : ""));
  }
  std::vector<Layer> out = layers(model);
  PARALLAX_CHECK(!out.empty(), ConfigError,
                 "key 'qat.enabled': model '{}' has no layer left to quantize ({} linear/conv "
                 "layers, {} skipped by qat.skip; QAT quantizes the models' DenseLinear and conv "
                 "layers)",
                 model.name(), all.size(), n_skipped);
  if (skipped) *skipped = n_skipped;
  return out;
}

void set_state(const std::vector<Layer>& ls, QuantState state) {
  for (const auto& l : ls) {
    l.input->set_state(state);
    if (l.weight) l.weight->set_state(state);
  }
}

namespace {

// One error naming the pool batch whose fp32 loss is not finite.
void check_pool_loss(double loss, int64_t i, int64_t n) {
  PARALLAX_CHECK(std::isfinite(loss), ConfigError,
                 "key 'qat.calib_select': the fp32 loss of calibration pool batch {} (of {}) is "
                 "{}; a model that is not finite on its own training data cannot be calibrated "
                 "(check train.load_from and the data)",
                 i + 1, n, loss);
}

}  // namespace

std::vector<int64_t> hardest(const std::vector<double>& losses, int64_t k) {
  const auto n = static_cast<int64_t>(losses.size());
  PARALLAX_CHECK(k >= 1 && k <= n, ConfigError,
                 "keys 'qat.calib_batches' and 'qat.calib_pool': {} calibration batches cannot be "
                 "chosen from a pool of {}",
                 k, n);
  for (int64_t i = 0; i < n; ++i) check_pool_loss(losses[static_cast<std::size_t>(i)], i, n);
  std::vector<int64_t> order(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return losses[static_cast<std::size_t>(a)] > losses[static_cast<std::size_t>(b)];
  });
  order.resize(static_cast<std::size_t>(k));
  return order;
}

int64_t calib_pool(const QatConfig& cfg) {
  if (cfg.calib_pool == 0) return 20 * cfg.calib_batches;
  PARALLAX_CHECK(cfg.calib_pool >= cfg.calib_batches, ConfigError,
                 "keys 'qat.calib_pool' and 'qat.calib_batches': a pool of {} batches cannot "
                 "supply {} calibration batches; set qat.calib_pool >= qat.calib_batches (or 0: 20 "
                 "x calib_batches)",
                 cfg.calib_pool, cfg.calib_batches);
  return cfg.calib_pool;
}

namespace {

// qat.calib_select=hardest: draws the pool, scores each batch by the fp32 loss (the caller holds
// eval mode and no-grad; every quantizer off) and keeps the calib_batches hardest, in stream order.
// Holds at most calib_batches + 1 batches: a kept batch is dropped once calib_batches harder ones
// are held (ties: the earlier one stays, as hardest() decides).
std::vector<core::TensorDict> hardest_batches(const std::vector<Layer>& ls, const QatConfig& cfg,
                                              const TrainingStart& start, CalibrationStop& stop,
                                              std::map<std::string, double>& m) {
  set_state(ls, QuantState::kDisabled);
  const int64_t pool = calib_pool(cfg);
  std::vector<double> losses;
  std::map<int64_t, core::TensorDict> kept;
  double sum = 0;
  for (int64_t i = 0; i < pool; ++i) {
    stop.check(0, i, pool);
    core::TensorDict b = start.next_batch();
    const double loss = start.model.loss(b, start.forward(b)).total.item<double>();
    losses.push_back(loss);
    sum += loss;
    check_pool_loss(loss, i, pool);  // a NaN is reported here, at its batch
    kept.emplace(i, std::move(b));
    if (static_cast<int64_t>(kept.size()) > cfg.calib_batches) {
      // Drop the easiest kept batch: the lowest loss, of equal losses the later batch (hardest()'s
      // order), so the kept set is hardest() of the losses so far, in O(calib_batches) per batch.
      auto easiest = kept.begin();
      for (auto it = std::next(kept.begin()); it != kept.end(); ++it) {
        const double l = losses[static_cast<std::size_t>(it->first)];
        const double e = losses[static_cast<std::size_t>(easiest->first)];
        if (l < e || (l == e && it->first > easiest->first)) easiest = it;
      }
      kept.erase(easiest);
    }
  }
  const std::vector<int64_t> top = hardest(losses, cfg.calib_batches);
  std::vector<core::TensorDict> out;
  double lowest = INFINITY;
  for (const auto& [i, b] : kept) {
    out.push_back(b);
    lowest = std::min(lowest, losses[static_cast<std::size_t>(i)]);
  }
  m["calib_pool"] = static_cast<double>(pool);
  m["calib_pool_loss_mean"] = sum / static_cast<double>(pool);
  m["calib_loss_min"] = lowest;
  core::log::info(
      "QAT: calibrating on the {} hardest of {} batches (qat.calib_select=hardest): fp32 loss >= "
      "{:.4g}, against a pool mean of {:.4g}",
      top.size(), pool, lowest, m["calib_pool_loss_mean"]);
  return out;
}

}  // namespace

std::map<std::string, double> calibrate(const std::vector<Layer>& ls, const QatConfig& cfg,
                                        const TrainingStart& start) {
  core::Stopwatch clock;
  const bool was_training = start.model.is_training();
  start.model.eval();
  at::NoGradGuard no_grad;
  CalibrationStop stop(start, cfg.calib_batches);
  std::map<std::string, double> m;
  const bool histogram = cfg.calibrator != "max";
  // The batches, kept for the second pass only (the histograms' range is pass 1's max): drawn and
  // run one at a time, so the max calibrator holds one batch whatever calib_batches is. The
  // hardest selection holds its chosen batches from the start.
  std::vector<core::TensorDict> batches;
  const bool select = cfg.calib_select == "hardest";
  if (select) batches = hardest_batches(ls, cfg, start, stop, m);
  const auto n = static_cast<int64_t>(ls.size());
  for (const auto& l : ls) {
    if (l.weight) l.weight->set_state(QuantState::kDisabled);
    l.input->begin_pass(CalibPass::kMax);
  }
  for (int64_t i = 0; i < cfg.calib_batches; ++i) {
    stop.check(1, i);
    if (select) {
      start.forward(batches[static_cast<std::size_t>(i)]);
      continue;
    }
    core::TensorDict b = start.next_batch();
    start.forward(b);
    if (histogram) batches.push_back(std::move(b));
  }
  if (!histogram) stop.finish();
  // Pass 1: max |x| per input quantizer, the max over the data-parallel group.
  at::Tensor maxes = at::zeros({n}, at::kFloat);
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& m = ls[static_cast<std::size_t>(i)].input->calib_max();
    if (m.defined()) maxes[i] = m.to(at::kCPU).item<float>();
  }
  maxes = reduce(maxes, parallel::comm::ReduceOp::kMax, start.dp, start.device);
  at::Tensor amax = maxes.clone();
  if (histogram) {
    // Pass 2: histograms of |x| over [0, max], summed over the group bin by bin.
    for (int64_t i = 0; i < n; ++i) {
      const double range = maxes[i].item<double>();
      auto& q = ls[static_cast<std::size_t>(i)].input;
      if (range > 0) {
        q->begin_pass(CalibPass::kHistogram, range);
      } else {
        q->set_state(QuantState::kDisabled);  // never reached: nothing to histogram
      }
    }
    for (std::size_t i = 0; i < batches.size(); ++i) {
      stop.check(2, static_cast<int64_t>(i));
      start.forward(batches[i]);
    }
    stop.finish();
    at::Tensor hist = at::zeros({n, models::kHistogramBins}, at::kDouble);
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor& h = ls[static_cast<std::size_t>(i)].input->histogram();
      if (h.defined()) hist[i].copy_(h.to(at::kCPU));
    }
    hist = reduce(hist, parallel::comm::ReduceOp::kSum, start.dp, start.device);
    for (int64_t i = 0; i < n; ++i) {
      const double range = maxes[i].item<double>();
      if (range <= 0) continue;
      amax[i] = cfg.calibrator == "percentile"
                    ? models::percentile_amax(hist[i], range, cfg.percentile)
                    : models::mse_amax(hist[i], range);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const Layer& l = ls[static_cast<std::size_t>(i)];
    l.input->freeze(amax[i]);
    if (l.weight) l.weight->set_state(QuantState::kQuantizing);
  }
  if (was_training) start.model.train();
  m["calib_layers"] = static_cast<double>(n);
  int64_t adds = 0, attention = 0, weights = 0;
  for (const auto& l : ls) {
    adds += l.is_add();
    attention += l.kind == Layer::Kind::kAttention;
    weights += l.weight != nullptr;
  }
  m["calib_adds"] = static_cast<double>(adds);
  if (attention > 0) m["calib_attention_inputs"] = static_cast<double>(attention);
  m["calib_quantizers"] = static_cast<double>(n + weights);
  m["calib_batches"] = static_cast<double>(cfg.calib_batches);
  m["calib_unseen"] = (maxes <= 0).sum().item<double>();
  const at::Tensor seen = amax.masked_select(maxes > 0);
  m["calib_amax_min"] = seen.numel() > 0 ? seen.min().item<double>() : NAN;
  m["calib_amax_max"] = seen.numel() > 0 ? seen.max().item<double>() : NAN;
  m["calib_amax_mean"] = seen.numel() > 0 ? seen.mean().item<double>() : NAN;
  double wmax = 0;
  for (const auto& l : ls)
    if (l.weight) wmax = std::max(wmax, l.weight->amax.max().item<double>());
  m["calib_weight_amax_max"] = wmax;
  m["calib_s"] = clock.elapsed_s();
  return m;
}

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

SweepResult sweep(models::Model& model, const std::vector<Layer>& ls, const QatConfig& cfg,
                  const TrainingStart& start) {
  const std::string& key = cfg.budget_metric;
  SweepResult r;
  auto metric = [&](const std::map<std::string, double>& m) {
    const auto it = m.find(key);
    PARALLAX_CHECK(it != m.end(), ConfigError,
                   "key 'qat.budget_metric': the evaluation reports no '{}' (it has {})", key, [&] {
                     std::vector<std::string> k;
                     for (const auto& [name, v] : m) k.push_back(name);
                     return core::join(k, ", ");
                   }());
    return it->second;
  };
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
  // Weight elements per layer (an Add has none).
  std::vector<double> weight_elems(ls.size(), 0);
  {
    const auto params = model.named_parameters();
    for (std::size_t i = 0; i < ls.size(); ++i) {
      if (!ls[i].weight) continue;
      if (const at::Tensor* w = params.find(ls[i].path + ".weight"))
        weight_elems[i] = static_cast<double>(w->numel());
    }
  }
  double all_elems = 0;
  for (double e : weight_elems) all_elems += e;
  auto fraction = [&](const std::set<std::size_t>& fp16) {
    double q = 0;
    for (std::size_t i = 0; i < ls.size(); ++i)
      if (!fp16.count(i)) q += weight_elems[i];
    return all_elems > 0 ? q / all_elems : 0.0;
  };
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
        "{{\"fp16_units\": [{}], \"{}\": {}, \"drop_points\": {}, \"int8_layers\": {}, "
        "\"int8_weight_fraction\": {}}}",
        [&] {
          std::vector<std::string> q;
          for (const auto& u : fp16_units) q.push_back(core::json_quote(u));
          return core::join(q, ", ");
        }(),
        key, core::json_number(v), core::json_number((r.fp32 - v) * 100),
        static_cast<int64_t>(ls.size() - fp16.size()), core::json_number(fraction(fp16)));
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
  r.int8_weight_fraction = fraction(fp16);
  // An attention's four inputs are skipped by its module path (with its qkv and proj, of the same
  // unit and so also in fp16).
  for (std::size_t i : fp16) {
    const std::string p = ls[i].module_path();
    if (std::find(r.skip.begin(), r.skip.end(), p) == r.skip.end()) r.skip.push_back(p);
  }
  set_state(ls, QuantState::kQuantizing);
  if (!start.report_dir.empty()) {
    std::vector<std::string> skip_q;
    for (const auto& p : r.skip) skip_q.push_back(core::json_quote(p));
    const std::string json = fmt::format(
        "{{\n  \"metric\": {},\n  \"budget_points\": {},\n  \"met\": {},\n  \"fp32\": {},\n  "
        "\"quantized\": {},\n  \"units\": [{}],\n  \"steps\": [\n    {}\n  ],\n  \"fp16_units\": "
        "[{}],\n  \"skip\": [{}],\n  \"layers\": {},\n  \"int8_layers\": {},\n  "
        "\"int8_weight_fraction\": {},\n  \"chosen\": {}\n}}\n",
        core::json_quote(key), core::json_number(cfg.budget), r.met ? "true" : "false",
        json_metrics(fp32), json_metrics(all), core::join(unit_json, ", "),
        core::join(steps_json, ",\n    "),
        [&] {
          std::vector<std::string> q;
          for (const auto& u : r.fp16_units) q.push_back(core::json_quote(u));
          return core::join(q, ", ");
        }(),
        core::join(skip_q, ", "), r.layers, r.int8_layers,
        core::json_number(r.int8_weight_fraction), core::json_number(value));
    const std::string path =
        (std::filesystem::path(start.report_dir) / "quantize_sweep.json").string();
    core::write_file_atomic(path, json);
  }
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
                 cfg.qat.mode);
  PARALLAX_CHECK(!cfg.qat.sensitivity || !uses_synthetic_data(cfg), ConfigError,
                 "key 'qat.sensitivity': the report compares evaluations, which need a dataset; "
                 "set data.path (and data.synthetic=false) or qat.sensitivity=false");
  PARALLAX_CHECK(cfg.qat.budget == 0 || !uses_synthetic_data(cfg), ConfigError,
                 "key 'qat.budget': the sweep compares evaluations, which need a dataset; set "
                 "data.path (and data.synthetic=false) or qat.budget=0");
  PARALLAX_CHECK(cfg.qat.budget == 0 || parse_qat_mode(cfg.qat.mode) == QatMode::kPtq, ConfigError,
                 "key 'qat.budget': the sweep chooses which layers a PTQ model quantizes; set "
                 "qat.mode=ptq (then fine-tune the chosen configuration with qat.mode=qat and "
                 "qat.skip from its quantize_sweep.json)");
  PARALLAX_CHECK(!cfg.qat.learn_scales || parse_qat_mode(cfg.qat.mode) == QatMode::kQat,
                 ConfigError,
                 "key 'qat.learn_scales': scales are learned by training; set qat.mode=qat (PTQ "
                 "takes no step)");
  if (cfg.qat.calib_select == "hardest") (void)calib_pool(cfg.qat);  // a bad pool: now, not later
  auto state = std::make_shared<State>();
  state->cfg = &cfg;
  TrainerHooks h;
  h.trains = parse_qat_mode(cfg.qat.mode) == QatMode::kQat;
  h.transform_defers = true;
  h.transform_model = [state](models::Model& m) {
    const QatConfig& c = state->cfg->qat;
    int64_t skipped = 0;
    state->layers = apply(m, c, &skipped);
    if (core::DeferredInit* d = core::deferred_init()) {
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
    const QatConfig& c = state->cfg->qat;
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
    s.set_extra("qat.mode", state->cfg->qat.mode);
    s.set_extra("qat.calibrator", state->cfg->qat.calibrator);
  };
  h.load_extra = [state](checkpoint::CheckpointReader& r) {
    PARALLAX_CHECK(r.metadata().has_extra("qat.calibrator"), CheckpointError,
                   "checkpoint '{}' holds no QAT amax (saved without qat.enabled); start a QAT "
                   "run from its weights with train.load_from={} instead of resuming it",
                   r.dir(), r.dir());
  };
  return h;
}

namespace {

class QdqHooks : public models::onnx::EmitHooks {
 public:
  explicit QdqHooks(const std::vector<Layer>& layers) {
    for (const auto& l : layers) by_path_[l.path] = l;
  }
  models::onnx::Value layer_input(models::onnx::Emitter& e, const std::string& layer,
                                  const models::onnx::Value& x) override {
    return wrap(e, layer, "input", x);
  }
  const std::vector<ActivationQdq>& activations() const { return activations_; }
  models::onnx::Value layer_weight(models::onnx::Emitter& e, const std::string& layer,
                                   const models::onnx::Value& w) override {
    return wrap(e, layer, "weight", w);
  }
  models::onnx::Value add_input(models::onnx::Emitter& e, const std::string& block,
                                const models::onnx::Value& x) override {
    return wrap(e, block, "add", x);
  }
  models::onnx::Value attention_input(models::onnx::Emitter& e, const std::string& attention,
                                      const char* which, const models::onnx::Value& x) override {
    return wrap(e, attention + "." + which, "attention", x);
  }

 private:
  // `x` through the layer's `what` ("input" / "weight") quantizer, if it has one; its amax buffer
  // is read through the pair's scale.
  models::onnx::Value wrap(models::onnx::Emitter& e, const std::string& layer, const char* what,
                           const models::onnx::Value& x) const {
    const auto it = by_path_.find(layer);
    if (it == by_path_.end()) return x;
    const std::string kind = what;
    if ((kind == "add") != it->second.is_add()) return x;
    const bool attention = it->second.kind == Layer::Kind::kAttention;
    if ((kind == "attention") != attention) return x;
    const auto& q = kind == "weight" ? it->second.weight : it->second.input;
    if (!q) return x;
    // An attention input's quantizer is "<attention>.<q|k|v|p>_quantizer".
    e.mark_read(layer + (attention ? "" : "." + kind) + "_quantizer.amax");
    std::string q_output;
    const models::onnx::Value y = qdq(e, layer, what, x, *q, &q_output);
    if (kind != "weight") {
      auto a = std::find_if(activations_.begin(), activations_.end(),
                            [&](const ActivationQdq& r) { return r.quantizer == q; });
      if (a == activations_.end()) a = activations_.insert(activations_.end(), {layer, q, {}});
      a->outputs.push_back(q_output);
    }
    return y;
  }

  static models::onnx::Value qdq(models::onnx::Emitter& e, const std::string& layer,
                                 const char* what, const models::onnx::Value& x,
                                 const models::TensorQuantizerImpl& q, std::string* q_output) {
    PARALLAX_CHECK(q.state() == models::QuantState::kQuantizing, Error,
                   "QAT export: the {} quantizer of layer '{}' is not calibrated (frozen)", what,
                   layer);
    PARALLAX_CHECK(e.dtype() == at::kFloat, ConfigError,
                   "key 'export.dtype': a QAT model exports in fp32 (QuantizeLinear of float16 "
                   "needs opset 19; this exporter writes opset 17)");
    const at::Tensor scale = q.scale().detach().to(at::kCPU, at::kFloat).contiguous();
    const bool per_channel = q.per_channel();
    const models::onnx::Value s = per_channel ? e.constant(scale) : e.constant(scale.reshape({}));
    const models::onnx::Value zp = per_channel ? e.constant(at::zeros({scale.numel()}, at::kChar))
                                               : e.constant(at::zeros({}, at::kChar));
    std::vector<models::onnx::Attr> attrs;
    if (per_channel) attrs.push_back({"axis", int64_t{0}});
    const models::onnx::Value qx = e.op("QuantizeLinear", {x, s, zp}, attrs);
    *q_output = qx.name;
    return e.op("DequantizeLinear", {qx, s, zp}, attrs);
  }

  std::map<std::string, Layer> by_path_;
  // `wrap` is const (called from the emitters through the hooks); what it wrote is recorded here.
  mutable std::vector<ActivationQdq> activations_;
};

}  // namespace

std::unique_ptr<models::onnx::EmitHooks> export_hooks(const std::vector<Layer>& layers) {
  return std::make_unique<QdqHooks>(layers);
}

std::vector<ActivationQdq> activation_qdq(const models::onnx::EmitHooks& hooks) {
  const auto* h = dynamic_cast<const QdqHooks*>(&hooks);
  PARALLAX_CHECK(h != nullptr, Error, "QAT export: hooks not made by qat::export_hooks()");
  return h->activations();
}

}  // namespace parallax::train::qat
