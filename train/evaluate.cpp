#include "train/evaluate.h"

#include "core/log.h"
#include "core/timer.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "data/metrics.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cmath>

namespace parallax::train {
namespace {

namespace comm = parallel::comm;

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
  at::Tensor padded = at::zeros({std::max<int64_t>(max_rows, 1) * cols}, at::TensorOptions().dtype(at::kFloat).device(dev));
  if (rows.size(0) > 0) padded.narrow(0, 0, rows.numel()).copy_(rows.to(at::kFloat).reshape({-1}));
  std::vector<at::Tensor> parts;
  for (int r = 0; r < dp.size(); ++r) parts.push_back(at::empty_like(padded));
  dp.all_gather(padded, parts);
  std::vector<at::Tensor> out;
  for (int r = 0; r < dp.size(); ++r) out.push_back(parts[r].narrow(0, 0, n[r] * cols).reshape({n[r], cols}).cpu());
  return at::cat(out).to(at::kDouble);
}

}  // namespace

std::map<std::string, double> evaluate(models::Model& model, const data::DataConfig& cfg, const core::SceneSpec& scene,
                                       uint64_t seed, comm::Communicator& dp, const c10::Device& device,
                                       const optim::PrecisionPolicy& precision) {
  core::Stopwatch clock;
  auto ds = data::Dataset::open(cfg.path, cfg.val_split);
  data::DataLoader loader(ds, data::LoaderOptions::from_config(cfg, seed, dp.rank(), dp.size(), false));
  data::BevIouMetric iou(static_cast<int64_t>(scene.bev_classes.size()));
  data::DetectionApMetric det(static_cast<int64_t>(scene.box_classes.size()));
  const bool was_training = model.is_training();
  model.eval();
  double loss_sum = 0;
  int64_t batches = 0;
  {
    at::NoGradGuard no_grad;
    while (auto batch = loader.next()) {
      const core::TensorDict b = core::to_device(*batch, device);
      core::TensorDict pred;
      models::LossOutput loss;
      {
        optim::AutocastGuard autocast(precision);
        pred = model.forward(b);
        loss = model.loss(b, pred);
      }
      loss_sum += loss.total.item<double>();
      ++batches;
      const core::TensorDict post = model.postprocess(pred);
      iou.update(post.at("bev_labels").cpu(), batch->at("bev_semantics"));
      det.update(post.at("det_boxes").to(at::kFloat).cpu(), post.at("det_scores").to(at::kFloat).cpu(),
                 batch->at("boxes"), batch->at("scene_index"));
    }
  }
  if (was_training) model.train();

  // Sums across ranks: IoU counts and the loss.
  const c10::Device dev = dp.device_type() == c10::kCPU ? c10::Device(c10::kCPU) : device;
  at::Tensor counts = iou.counts().to(dev);
  dp.all_reduce(counts, comm::ReduceOp::kSum);
  iou.set_counts(counts.cpu());
  at::Tensor loss_t = at::tensor({loss_sum, static_cast<double>(batches)}, at::kFloat).to(dev);
  dp.all_reduce(loss_t, comm::ReduceOp::kSum);
  loss_t = loss_t.cpu();
  // Detections: every rank gathers every rank's rows and computes the same AP.
  const core::TensorDict packed = det.pack();
  data::DetectionApMetric all(static_cast<int64_t>(scene.box_classes.size()));
  all.merge({{"pred", gather_rows(packed.at("pred"), dp, device)}, {"gt", gather_rows(packed.at("gt"), dp, device)}});

  std::map<std::string, double> m;
  m["val_loss"] = loss_t[1].item<double>() > 0 ? loss_t[0].item<double>() / loss_t[1].item<double>() : NAN;
  const auto ious = iou.iou();
  for (std::size_t c = 0; c < ious.size() && c < scene.bev_classes.size(); ++c) m["iou_" + scene.bev_classes[c]] = ious[c];
  m["miou"] = iou.miou();
  const data::DetectionResult r = all.compute();
  m["map"] = r.map;
  for (std::size_t t = 0; t < r.thresholds.size(); ++t) m[fmt::format("map_{}m", r.thresholds[t])] = r.map_at[t];
  for (std::size_t c = 0; c < r.ap.size() && c < scene.box_classes.size(); ++c) {
    for (std::size_t t = 0; t < r.thresholds.size(); ++t) {
      if (r.thresholds[t] == 2.0) m["ap_2m_" + scene.box_classes[c]] = r.ap[c][t];
    }
  }
  m["eval_s"] = clock.elapsed_s();
  core::log::info("eval on '{}' ({} batches/rank): val_loss {:.4f} | mIoU {:.3f} | vehicle IoU {:.3f} | mAP {:.3f} | "
                  "mAP@2m {:.3f} | {:.1f}s",
                  cfg.val_split, batches, m["val_loss"], m["miou"], m.count("iou_vehicle") ? m["iou_vehicle"] : NAN,
                  m["map"], m.count("map_2m") ? m["map_2m"] : NAN, m["eval_s"]);
  return m;
}

}  // namespace parallax::train
