#include "train/evaluate.h"

#include "core/log.h"
#include "core/timer.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "data/metrics.h"
#include "data/schema.h"
#include "train/preemption.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace parallax::train {
namespace {

// Rows of a 2-D float64 tensor from every rank, concatenated in rank order (variable row counts).
at::Tensor gather_rows(const at::Tensor& rows, comm::Communicator& dp, const c10::Device& device) {
  const int64_t cols = rows.size(1);
  const c10::Device dev = dp.device_type() == c10::kCPU ? c10::Device(c10::kCPU) : device;
  at::Tensor count = at::full({1}, rows.size(0), at::TensorOptions().dtype(at::kLong).device(dev));
  std::vector<at::Tensor> counts;
  for (int r = 0; r < dp.size(); ++r) counts.push_back(at::empty_like(count));
  dp.all_gather(count, counts);
  int64_t max_rows = 0;
  std::vector<int64_t> n;
  for (auto& c : counts) {
    n.push_back(c.item<int64_t>());
    max_rows = std::max(max_rows, n.back());
  }
  // float32 carries scene ids (< 2^24), class ids, metres and scores exactly enough.
  at::Tensor padded = at::zeros({std::max<int64_t>(max_rows, 1) * cols},
                                at::TensorOptions().dtype(at::kFloat).device(dev));
  if (rows.size(0) > 0) padded.narrow(0, 0, rows.numel()).copy_(rows.to(at::kFloat).reshape({-1}));
  std::vector<at::Tensor> parts;
  for (int r = 0; r < dp.size(); ++r) parts.push_back(at::empty_like(padded));
  dp.all_gather(padded, parts);
  std::vector<at::Tensor> out;
  for (int r = 0; r < dp.size(); ++r)
    out.push_back(parts[r].narrow(0, 0, n[r] * cols).reshape({n[r], cols}).cpu());
  return at::cat(out).to(at::kDouble);
}

// Rows of `pred_rows` [P, 11] and `gt_rows` [G, 9] (EvalDetections) from one batch.
void append_rows(const at::Tensor& det_in, const at::Tensor& scores_in, const at::Tensor& gt_in,
                 const at::Tensor& ids_in, int64_t num_classes, std::vector<double>& pred_rows,
                 std::vector<double>& gt_rows) {
  const at::Tensor det = det_in.to(at::kDouble).contiguous();
  const at::Tensor scores = scores_in.to(at::kDouble).contiguous();
  const at::Tensor gt = gt_in.to(at::kDouble).contiguous();
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t B = ids.size(0), K = det.size(1), G = gt.size(1), Cd = det.size(2);
  for (int64_t b = 0; b < B; ++b) {
    const auto sample = static_cast<double>(ids.data_ptr<int64_t>()[b]);
    for (int64_t k = 0; k < K; ++k) {
      const double* r = det.data_ptr<double>() + (b * K + k) * Cd;
      const auto cls = std::lround(r[data::kBoxClass]);
      if (cls < 0 || cls >= num_classes) continue;
      const double row[11] = {sample,
                              static_cast<double>(cls),
                              r[0],
                              r[1],
                              r[2],
                              r[3],
                              r[4],
                              r[5],
                              r[data::kBoxYaw],
                              scores.data_ptr<double>()[b * K + k],
                              static_cast<double>(k)};
      pred_rows.insert(pred_rows.end(), row, row + 11);
    }
    for (int64_t k = 0; k < G; ++k) {
      const double* r = gt.data_ptr<double>() + (b * G + k) * data::kBoxColumns;
      const auto cls = std::lround(r[data::kBoxClass]);
      if (cls < 0 || cls >= num_classes || !(r[data::kBoxVisibility] > 0)) continue;
      const double row[9] = {sample, static_cast<double>(cls), r[0], r[1], r[2], r[3], r[4],
                             r[5],   r[data::kBoxYaw]};
      gt_rows.insert(gt_rows.end(), row, row + 9);
    }
  }
}

// Sample `b` of a batch of `batch` samples: every tensor of `d` whose first dimension is the
// batch, narrowed to that sample (kept 4-D etc.); any other tensor whole.
core::TensorDict sample_of(const core::TensorDict& d, int64_t b, int64_t batch) {
  core::TensorDict out;
  for (const auto& [k, t] : d)
    out.emplace(k, t.dim() > 0 && t.size(0) == batch ? t.narrow(0, b, 1) : t);
  return out;
}

at::Tensor rows_tensor(std::vector<double>& rows, int64_t cols) {
  const auto n = static_cast<int64_t>(rows.size()) / cols;
  if (n == 0) return at::empty({0, cols}, at::kDouble);
  return at::from_blob(rows.data(), {n, cols}, at::kDouble).clone();
}

// The detection metrics of `r` and `tp` into `m`: mAP (and per threshold), AP per class (mean over
// the thresholds, and at 2 m), the true-positive errors per class and their means, and NDS.
void add_detection_metrics(const data::DetectionResult& r, const data::TpErrors& tp,
                           const core::SceneSpec& scene, std::map<std::string, double>& m) {
  m["map"] = r.map;
  for (std::size_t t = 0; t < r.thresholds.size(); ++t)
    m[fmt::format("map_{}m", r.thresholds[t])] = r.map_at[t];
  for (std::size_t c = 0; c < r.ap.size() && c < scene.box_classes.size(); ++c) {
    for (std::size_t t = 0; t < r.thresholds.size(); ++t) {
      if (r.thresholds[t] == 2.0) m["ap_2m_" + scene.box_classes[c]] = r.ap[c][t];
    }
    double ap = 0;
    for (double a : r.ap[c]) ap += a;
    m["ap_" + scene.box_classes[c]] = ap / static_cast<double>(r.ap[c].size());
    m["ate_" + scene.box_classes[c]] = tp.ate[c];
    m["ase_" + scene.box_classes[c]] = tp.ase[c];
    m["aoe_" + scene.box_classes[c]] = tp.aoe[c];
  }
  m["ate"] = tp.mate;
  m["ase"] = tp.mase;
  m["aoe"] = tp.maoe;
  // NDS without velocity and attributes (docs/data.md): (5 mAP + sum of (1 - min(1, err))) / 10.
  m["nds"] = (5 * r.map + (1 - std::min(1.0, tp.mate)) + (1 - std::min(1.0, tp.mase)) +
              (1 - std::min(1.0, tp.maoe))) /
             10;
}

}  // namespace

std::map<std::string, double> evaluate(models::Model& model, const data::DataConfig& cfg,
                                       const core::SceneSpec& scene, uint64_t seed,
                                       comm::Communicator& dp, const c10::Device& device,
                                       const optim::PrecisionPolicy& precision,
                                       EvalDetections* detections) {
  core::Stopwatch clock;
  auto ds = data::Dataset::open(cfg.path, cfg.val_split);
  data::DataLoader loader(ds,
                          data::LoaderOptions::from_config(cfg, seed, dp.rank(), dp.size(), false));
  data::BevIouMetric iou(static_cast<int64_t>(scene.bev_classes.size()));
  const auto num_boxes = static_cast<int64_t>(scene.box_classes.size());
  std::vector<double> pred_rows, gt_rows;
  const bool was_training = model.is_training();
  model.eval();
  // val_loss is the mean over the split's samples of each sample's own loss: the model's loss
  // normalises by counts in its batch (class frequencies, positives), so a batch's loss is not
  // the mean of its samples' and a mean of batch losses would depend on how the scenes fall into
  // batches and ranks. The sum stays on the device (one copy at the end), in float64.
  const c10::Device dev = dp.device_type() == c10::kCPU ? c10::Device(c10::kCPU) : device;
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(device));
  int64_t samples = 0, batches = 0;
  bool stopped = false;  // preemption (train/preemption.h): this rank stopped before the end
  {
    at::NoGradGuard no_grad;
    while (auto batch = loader.next()) {
      if (PreemptionSignals::requested()) {
        stopped = true;
        break;
      }
      const core::TensorDict b = core::to_device(*batch, device);
      const int64_t n = batch->at("scene_index").size(0);
      core::TensorDict pred;
      {
        optim::AutocastGuard autocast(precision);
        pred = model.forward(b);
        for (int64_t i = 0; i < n; ++i) {
          const models::LossOutput loss = model.loss(sample_of(b, i, n), sample_of(pred, i, n));
          loss_sum += loss.total.detach().to(at::kDouble);
        }
      }
      samples += n;
      ++batches;
      const core::TensorDict post = model.postprocess(pred);
      iou.update(post.at("bev_labels").cpu(), batch->at("bev_semantics"));
      append_rows(post.at("det_boxes").to(at::kFloat).cpu(),
                  post.at("det_scores").to(at::kFloat).cpu(), batch->at("boxes"),
                  batch->at("scene_index"), num_boxes, pred_rows, gt_rows);
    }
  }
  if (was_training) model.train();
  // Every rank reaches this collective, stopped early or not, and all learn whether one stopped.
  {
    at::Tensor stop =
        at::full({1}, stopped ? 1.0f : 0.0f,
                 at::TensorOptions()
                     .dtype(at::kFloat)
                     .device(dp.device_type() == c10::kCPU ? c10::Device(c10::kCPU) : device));
    dp.all_reduce(stop, comm::ReduceOp::kMax);
    if (stop.item<float>() > 0) {
      throw PreemptedError(fmt::format(
          "preempted during the evaluation on '{}' (rank {}: {}): no eval metrics were written",
          cfg.val_split, dp.rank(),
          stopped ? fmt::format("stopped after {} batches", batches) : "another rank stopped"));
    }
  }

  // Sums across ranks: IoU counts, and the loss sum with the sample count in float64 (exact
  // counts; each rank's float64 sum rounded once more in the reduction, never to float32).
  at::Tensor counts = iou.counts().to(dev);
  dp.all_reduce(counts, comm::ReduceOp::kSum);
  iou.set_counts(counts.cpu());
  at::Tensor loss_t =
      at::stack({loss_sum.to(dev), at::full({}, static_cast<double>(samples),
                                            at::TensorOptions().dtype(at::kDouble).device(dev))});
  dp.all_reduce(loss_t, comm::ReduceOp::kSum);
  loss_t = loss_t.cpu();
  // Detections: every rank gathers every rank's rows and computes the same AP and errors. The
  // float32 transport is exact: the boxes and scores are float32 model outputs and labels.
  const at::Tensor pred_all = gather_rows(rows_tensor(pred_rows, 11), dp, device);
  const at::Tensor gt_all = gather_rows(rows_tensor(gt_rows, 9), dp, device);
  data::DetectionApMetric all(num_boxes);
  all.merge({{"pred", at::cat({pred_all.narrow(1, 0, 4), pred_all.narrow(1, 9, 2)}, 1)},
             {"gt", gt_all.narrow(1, 0, 4)}});
  const data::TpErrors tp = data::detection_tp_errors(pred_all, gt_all, num_boxes, 2.0);
  if (detections) *detections = {pred_all, gt_all};

  std::map<std::string, double> m;
  m["val_loss"] =
      loss_t[1].item<double>() > 0 ? loss_t[0].item<double>() / loss_t[1].item<double>() : NAN;
  const auto ious = iou.iou();
  for (std::size_t c = 0; c < ious.size() && c < scene.bev_classes.size(); ++c)
    m["iou_" + scene.bev_classes[c]] = ious[c];
  m["miou"] = iou.miou();
  add_detection_metrics(all.compute(), tp, scene, m);
  m["eval_s"] = clock.elapsed_s();
  core::log::info(
      "eval on '{}' ({} samples in {} batches on rank {}): val_loss {:.4f} | mIoU {:.3f} | "
      "vehicle IoU {:.3f} | mAP {:.3f} | mAP@2m {:.3f} | {:.1f}s",
      cfg.val_split, samples, batches, dp.rank(), m["val_loss"], m["miou"],
      m.count("iou_vehicle") ? m["iou_vehicle"] : NAN, m["map"],
      m.count("map_2m") ? m["map_2m"] : NAN, m["eval_s"]);
  return m;
}

}  // namespace parallax::train
