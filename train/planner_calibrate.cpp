// `parallax plan --calibrate`: the planner's hardware numbers measured by running the trainer.
#include "train/planner_calibrate.h"

#include "train/planner_inventory.h"
#include "train/trainer.h"

namespace parallax::train::planner {

using namespace detail;

namespace {

// The median step time of `steps` steps of the real training loop (benchmark mode: synthetic
// batches, no evaluation or checkpoints) of cfg's model in this one process, at micro-batch
// `batch`: the trainer's own optimizer, kernels and (if configured) CUDA graph, which a bare loop
// here would not reproduce. The run goes to a temporary directory, removed afterwards.
double trainer_step_ms(RunConfig cfg, int64_t batch, int steps, bool cuda) {
  namespace fs = std::filesystem;
  cfg.train.benchmark = true;
  cfg.train.steps = steps;
  cfg.train.log_every = 1;
  cfg.train.eval_every = 0;
  cfg.train.grad_accum = 1;
  cfg.train.device = cuda ? "cuda" : "cpu";
  cfg.data.batch_size = static_cast<int>(batch);
  cfg.parallel.dp = 0;
  cfg.parallel.tp = 1;
  cfg.parallel.pp = 1;
  cfg.parallel.zero.stage = 0;
  cfg.parallel.sequence_parallel = false;
  const fs::path dir = fs::temp_directory_path() / fmt::format("parallax_calibrate_{}", ::getpid());
  cfg.experiment.output_dir = dir.string();
  cfg.experiment.name = fmt::format("batch_{}", batch);
  (void)run_training(cfg);
  std::vector<double> ms;
  {
    std::ifstream f(dir / cfg.experiment.name / "metrics.jsonl");
    const std::regex kind("\"kind\": *\"train\""), step_ms("\"step_ms\": *([-0-9.eE+]+)");
    std::string line;
    std::smatch m;
    while (std::getline(f, line))
      if (std::regex_search(line, kind) && std::regex_search(line, m, step_ms))
        ms.push_back(std::stod(m[1]));
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  PARALLAX_CHECK(ms.size() >= 3, Error, "plan --calibrate: the calibration run logged {} steps",
                 ms.size());
  ms.erase(ms.begin(), ms.begin() + static_cast<std::ptrdiff_t>(ms.size() / 3));  // warm-up
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

Hardware calibrate(const RunConfig& cfg, Hardware hw, int steps, int64_t batch) {
  check_supported(cfg);
  if (batch <= 0) batch = cfg.data.batch_size;
  const bool cuda = hw.cuda && at::hasCUDA();
  // The calibration trains real steps: a batch whose activations alone exceed the device's memory
  // (the planner's own arithmetic) is refused before anything is allocated, and the doublings
  // below stop before such a batch (data.batch_size=10^9 ended in std::bad_alloc; issue 35).
  const double memory = hw.gpu_mem_gib * kGiB;
  const double act_per_sample = activation_bytes(cfg, 1, false, 1, cuda);  // linear in the batch
  const auto activations_of = [&](int64_t b) { return act_per_sample * static_cast<double>(b); };
  PARALLAX_CHECK(activations_of(batch) <= memory, UsageError,
                 "plan --calibrate: micro-batch {} (--calibrate-batch, else data.batch_size) keeps "
                 "{:.1f} GiB of activations, more than the {:.0f} GiB of --gpu-mem; calibrate on a "
                 "smaller batch",
                 batch, activations_of(batch) / kGiB, hw.gpu_mem_gib);
  PARALLAX_CHECK(!hw.cuda || cuda, UsageError,
                 "plan --calibrate: planning for GPUs but this machine has none; use --device cpu "
                 "or calibrate on the GPU machine");
  if (!cuda) {
    // The CPU's own peak: a large fp32 GEMM.
    const int64_t k = 1024;
    at::Tensor x = at::randn({k, k}), y = at::randn({k, k});
    (void)at::mm(x, y);
    core::Stopwatch w;
    const int reps = 8;
    for (int i = 0; i < reps; ++i) (void)at::mm(x, y);
    hw.peak_tflops = 2.0 * k * k * k * reps / w.elapsed_s() / 1e12;
  }
  // A first run warms the device (clocks, cuDNN/cuBLAS autotuning, the caching allocator) and
  // is discarded: measured first, the small batch came out slower than twice its size on an H100.
  (void)trainer_step_ms(cfg, batch, std::max(4, steps / 2), cuda);
  // Pairs b and 2b, doubling while the step does not grow by half: below that the step is
  // host-bound (the same launches whatever the batch; ViT-B/16 on an H100 takes ~23 ms at both 32
  // and 64), and the pair shows no slope. The smallest step is the host floor; the first pair
  // whose time grows gives the slope (the compute: FLOPs over the efficiency) and the intercept
  // (the fixed cost of a step). Up to 4 doublings; a batch that does not fit ends the search.
  const double floor_ms = trainer_step_ms(cfg, batch, steps, cuda);
  double t1 = floor_ms, t2 = 0;
  int64_t b1 = batch;
  for (int k = 0; k < 4; ++k) {
    if (activations_of(2 * b1) > memory) {
      core::log::warn(
          "plan --calibrate: batch {} would not fit in {:.0f} GiB; calibrating on batch {}", 2 * b1,
          hw.gpu_mem_gib, b1);
      t2 = 0;
      break;
    }
    try {
      t2 = trainer_step_ms(cfg, 2 * b1, steps, cuda);
    } catch (const std::exception& e) {
      core::log::warn("plan --calibrate: batch {} did not run ({}); calibrating on batch {}",
                      2 * b1, e.what(), b1);
      t2 = 0;
      break;
    }
    if (t2 >= 1.5 * t1) break;
    if (k == 3) break;
    b1 *= 2;
    t1 = t2;
  }
  // No pair grew: all of the largest batch's time is taken as compute (no fixed cost), which
  // over-predicts rather than under-predicts.
  const bool sloped = t2 >= 1.2 * t1;
  const double per_sample = sloped ? (t2 - t1) / static_cast<double>(b1)
                                   : std::max(t1, t2) / static_cast<double>(t2 > 0 ? 2 * b1 : b1);
  // The model shape-only, as `parallax plan` builds it (train/run.h).
  const auto model = build_run(cfg, Purpose::kPlan)->model;
  const double flops = 3.0 * model->forward_flops_per_sample();
  hw.efficiency = std::min(1.0, flops / (per_sample / 1e3) / (hw.peak_tflops * 1e12));
  hw.overhead_ms = sloped ? std::max(0.0, t1 - per_sample * static_cast<double>(b1)) : 0.0;
  hw.host_floor_ms = floor_ms;
  hw.source = fmt::format(
      "calibrated on this machine ({}): {} training steps of {}/{} from batch {}: {:.1f} ms at {}, "
      "{:.1f} ms at {}: {:.2f} ms fixed, host floor {:.1f} ms",
      cuda ? "cuda" : "cpu", steps, cfg.model.name, cfg.model.size, batch, t1, b1, t2, 2 * b1,
      hw.overhead_ms, hw.host_floor_ms);
  return hw;
}

}  // namespace parallax::train::planner
