#include "train/evaluate.h"

#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "data/dataset.h"
#include "data/detection_score.h"
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

// `key` of `d` as float [B, N, 2] on the CPU, or `fill` of that shape where `d` has no such key
// (velocities absent on a path: data/detection_score.h says what each side means then).
at::Tensor velocities_or(const core::TensorDict& d, const char* key, int64_t B, int64_t N,
                         float fill) {
  const auto it = d.find(key);
  if (it == d.end()) return at::full({B, N, 2}, fill, at::kFloat);
  const at::Tensor v = it->second.to(at::kCPU).to(at::kFloat).contiguous();
  PARALLAX_CHECK(v.dim() == 3 && v.size(0) == B && v.size(1) == N && v.size(2) == 2, Error,
                 "eval: '{}' must be [{}, {}, 2] beside its boxes, got [{}]", key, B, N,
                 fmt::join(v.sizes(), ", "));
  return v;
}

}  // namespace

void append_eval_rows(const core::TensorDict& post, const core::TensorDict& batch,
                      int64_t num_classes, std::vector<double>& pred_rows,
                      std::vector<double>& gt_rows) {
  const at::Tensor det =
      post.at("det_boxes").to(at::kCPU).to(at::kFloat).to(at::kDouble).contiguous();
  const at::Tensor scores =
      post.at("det_scores").to(at::kCPU).to(at::kFloat).to(at::kDouble).contiguous();
  const at::Tensor gt = batch.at("boxes").to(at::kCPU).to(at::kDouble).contiguous();
  const at::Tensor ids = batch.at("scene_index").to(at::kCPU).to(at::kLong).contiguous();
  const int64_t B = ids.size(0), K = det.size(1), G = gt.size(1), Cd = det.size(2);
  const at::Tensor dv = velocities_or(post, "det_velocities", B, K, 0.0f).to(at::kDouble);
  const at::Tensor gv = velocities_or(batch, "velocities", B, G, NAN).to(at::kDouble);
  const double* dvp = dv.data_ptr<double>();
  const double* gvp = gv.data_ptr<double>();
  for (int64_t b = 0; b < B; ++b) {
    const auto sample = static_cast<double>(ids.data_ptr<int64_t>()[b]);
    for (int64_t k = 0; k < K; ++k) {
      const double* r = det.data_ptr<double>() + (b * K + k) * Cd;
      const auto cls = std::lround(r[data::kBoxClass]);
      if (cls < 0 || cls >= num_classes) continue;
      const double* v = dvp + (b * K + k) * 2;
      const double row[data::kTpPredColumns] = {sample,
                                                static_cast<double>(cls),
                                                r[0],
                                                r[1],
                                                r[2],
                                                r[3],
                                                r[4],
                                                r[5],
                                                r[data::kBoxYaw],
                                                scores.data_ptr<double>()[b * K + k],
                                                static_cast<double>(k),
                                                v[0],
                                                v[1]};
      pred_rows.insert(pred_rows.end(), row, row + data::kTpPredColumns);
    }
    for (int64_t k = 0; k < G; ++k) {
      const double* r = gt.data_ptr<double>() + (b * G + k) * data::kBoxColumns;
      const auto cls = std::lround(r[data::kBoxClass]);
      if (cls < 0 || cls >= num_classes || !(r[data::kBoxVisibility] > 0)) continue;
      const double* v = gvp + (b * G + k) * 2;
      const double row[data::kTpGtColumns] = {
          sample, static_cast<double>(cls), r[0], r[1], r[2], r[3], r[4],
          r[5],   r[data::kBoxYaw],         v[0], v[1]};
      gt_rows.insert(gt_rows.end(), row, row + data::kTpGtColumns);
    }
  }
}

namespace {

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
      append_eval_rows(post, *batch, num_boxes, pred_rows, gt_rows);
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
  // float32 transport is exact: the boxes, scores and velocities are float32 model outputs and
  // labels (NaN, an unknown velocity, travels as NaN).
  const at::Tensor pred_all = gather_rows(rows_tensor(pred_rows, data::kTpPredColumns), dp, device);
  const at::Tensor gt_all = gather_rows(rows_tensor(gt_rows, data::kTpGtColumns), dp, device);
  data::DetectionApMetric all(num_boxes);
  all.merge({{"pred", at::cat({pred_all.narrow(1, 0, 4), pred_all.narrow(1, 9, 2)}, 1)},
             {"gt", gt_all.narrow(1, 0, 4)}});
  const data::TpErrors tp = data::detection_tp_errors(pred_all, gt_all, scene.box_classes, 2.0);
  if (detections) *detections = {pred_all, gt_all};

  std::map<std::string, double> m;
  m["val_loss"] =
      loss_t[1].item<double>() > 0 ? loss_t[0].item<double>() / loss_t[1].item<double>() : NAN;
  const auto ious = iou.iou();
  for (std::size_t c = 0; c < ious.size() && c < scene.bev_classes.size(); ++c)
    m["iou_" + scene.bev_classes[c]] = ious[c];
  m["miou"] = iou.miou();
  data::add_detection_metrics(all.compute(), tp, scene.box_classes, m);
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
