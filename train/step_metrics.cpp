// The step metrics of a run's loop (train/step_metrics.h).
#include "train/step_metrics.h"

#include "comm/topology.h"
#include "comm/world.h"
#include "core/error.h"
#include "models/model.h"
#include "optim/precision.h"
#include "parallel/engine.h"
#include "train/metrics.h"
#include "train/run_steps.h"

#include <ATen/DeviceAccelerator.h>
#include <fmt/format.h>

#include <sys/resource.h>

#include <cmath>
#include <vector>

namespace parallax::train::detail {

namespace {

// "NaN", "inf" or "-inf" (the platform prints "-nan" for some NaNs).
std::string nonfinite_name(double v) {
  return std::isnan(v) ? "NaN" : (v > 0 ? "inf" : "-inf");
}

// Peak memory of this rank in GiB: the device allocator's peak on GPUs, peak RSS on the CPU.
double peak_memory_gb(const c10::Device& device) {
  if (device.is_cuda()) {
    const auto stats = at::accelerator::getDeviceStats(device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0 * 1024.0);
  }
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<double>(ru.ru_maxrss) / (1024.0 * 1024.0);  // ru_maxrss is KiB on Linux
}

}  // namespace

StepMetrics::StepMetrics(Run& run, StepRunner& steps, int64_t total)
    : run_(run),
      steps_(steps),
      total_(total),
      // Rates and the ETA count the steps of this process only (a resumed run did the others).
      progress_("step", total, 5.0, run.start_step),
      // A resume at or past train.steps trains nothing: its summary names the checkpoint's step
      // and no loss (null), rather than step 0.
      last_loss_(NAN),
      last_logged_(run.start_step) {
  global_batch_ =
      static_cast<int64_t>(run.cfg.data.batch_size) * run.cfg.train.grad_accum * run.plan.layout.dp;
  flops_per_step_ =
      3.0 * run.model->forward_flops_per_sample() * static_cast<double>(global_batch_);
}

void StepMetrics::restart_interval() {
  interval_clock_.reset();
  interval_steps_ = 0;
  steps_.times().reset();
}

double StepMetrics::after_step(int64_t step, double lr, std::map<std::string, at::Tensor>& terms) {
  ++interval_steps_;
  if (logs(step)) return log_row(step, lr, terms);
  // On the CPU a finite-loss check is free; on GPUs it would sync every step, so it happens at log
  // steps (the error then names the interval).
  if (run_.device.is_cpu()) {
    const double v = terms["loss"].item<double>();
    if (!std::isfinite(v)) {
      throw_error<NumericsError>(
          "loss is {} at step {} on rank {} (metrics so far are in {}); {}", nonfinite_name(v),
          step, run_.world->rank(), (run_.dir / "metrics.jsonl").string(),
          nonfinite_loss_hint(run_, step, "lower optim.lr or check the data"));
    }
  }
  return NAN;
}

double StepMetrics::log_row(int64_t step, double lr, std::map<std::string, at::Tensor>& terms) {
  // Mean of every loss term over the data-parallel group (one small collective at log steps).
  const comm::CommPtr& dp = run_.topo->dp();
  const c10::Device reduce_device =
      dp->device_type() == c10::kCPU ? c10::Device(c10::kCPU) : run_.device;
  std::vector<std::string> keys;
  std::vector<at::Tensor> vals;
  for (const auto& [k, v] : terms) {
    keys.push_back(k);
    vals.push_back(v.to(at::kFloat).reshape({1}));
  }
  at::Tensor packed = at::cat(vals).to(reduce_device);
  if (dp->size() > 1) dp->all_reduce(packed, comm::ReduceOp::kAvg);
  packed = packed.cpu();
  const double loss = packed[0].item<double>();  // "loss" sorts first
  if (!std::isfinite(loss)) {
    throw_error<NumericsError>(
        "loss is {} at step {} (data-parallel mean; last finite log is in {}); {}",
        nonfinite_name(loss), step, (run_.dir / "metrics.jsonl").string(),
        nonfinite_loss_hint(run_, step, "lower optim.lr or use precision.mode=bf16"));
  }
  const double step_ms = 1000.0 * interval_clock_.elapsed_s() / interval_steps_;
  const StepTimes& t = steps_.times();
  const bool graph = run_.graph != nullptr;
  std::map<std::string, double> m;
  for (std::size_t i = 0; i < keys.size(); ++i)
    m[keys[i]] = packed[static_cast<int64_t>(i)].item<double>();
  m["lr"] = lr;
  m["grad_norm"] = steps_.grad_norm().defined() ? steps_.grad_norm().item<double>() : NAN;
  m["loss_scale"] = run_.precision.scaler().scale();
  m["skipped_steps"] = static_cast<double>(run_.precision.scaler().skipped_steps());
  m["step_ms"] = step_ms;
  m["data_ms"] = t.data_ms / interval_steps_;
  // Not measured inside a CUDA graph (DDP's timing events cannot be captured).
  m["comm_exposed_ms"] = graph ? NAN : t.comm_ms / interval_steps_;
  if (run_.engine->timed()) m["backward_ms"] = graph ? NAN : t.backward_ms / interval_steps_;
  m["img_per_s"] = global_batch_ * 1000.0 / step_ms;
  m["mem_gb"] = peak_memory_gb(run_.device);
  m["mfu"] = run_.device.is_cuda()
                 ? flops_per_step_ / (step_ms / 1000.0) /
                       (peak_flops_per_gpu(run_.precision.mode()) * run_.world->size())
                 : NAN;
  run_.metrics->write("train", step, m);
  progress_.update(step, fmt::format("loss {:.4f} | lr {:.2e} | {:.0f} ms/step | {:.1f} samples/s",
                                     loss, lr, step_ms, m["img_per_s"]));
  last_loss_ = loss;
  last_logged_ = step;
  restart_interval();
  return loss;
}

}  // namespace parallax::train::detail
