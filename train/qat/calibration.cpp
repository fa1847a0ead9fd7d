// The QAT calibration (qat.h, calibrate()): the activation amax of every input quantizer from
// training batches, in one or two passes (max, then a histogram for the percentile and mse
// calibrators), reduced over the data-parallel group so that every rank freezes the same amax;
// the hardest-batch selection (qat.calib_select=hardest); stopping on preemption; and the amax
// fingerprint the calibration log line prints.
#include "train/qat/qat.h"

#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "models/quant.h"
#include "train/preemption.h"
#include "train/trainer_hooks.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <zlib.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

namespace parallax::train::qat {

namespace {

using models::CalibPass;
using models::QuantState;

// Every rank's values [n] reduced by `op` over `dp` (null: this process alone), on the device its
// backend takes.
at::Tensor reduce(at::Tensor t, comm::ReduceOp op, const comm::CommPtr& dp, c10::Device device) {
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
  maxes = reduce(maxes, comm::ReduceOp::kMax, start.dp, start.device);
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
    hist = reduce(hist, comm::ReduceOp::kSum, start.dp, start.device);
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

}  // namespace parallax::train::qat
