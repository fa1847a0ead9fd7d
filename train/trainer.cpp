#include "train/trainer.h"

#include "core/error.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/rng.h"
#include "core/timer.h"
#include "models/model.h"
#include "train/metrics.h"

#include <torch/optim/adamw.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;

namespace parallax::train {
namespace {

void write_text_file(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw_error<IoError>("cannot write '{}' (disk full or no permission?)", tmp.string());
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw_error<IoError>("cannot rename '{}' to '{}': {}", tmp.string(), path.string(), ec.message());
}

}  // namespace

TrainSummary run_training(RunConfig& cfg) {
  const fs::path run_dir = fs::path(cfg.experiment.output_dir) / cfg.experiment.name;
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) throw_error<IoError>("cannot create run directory '{}': {}", run_dir.string(), ec.message());
  write_text_file(run_dir / "config.yaml", resolved_yaml(cfg));
  core::log::info("run directory: {}", run_dir.string());

  core::seed_all(static_cast<uint64_t>(cfg.experiment.seed));
  auto model = models::build_model(cfg.model, core::SceneSpec{});
  core::log::info("model {}/{}: {:.3f} M parameters", cfg.model.name, cfg.model.size,
                  model->parameter_count() / 1e6);

  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(cfg.optim.lr)
                              .betas({cfg.optim.betas[0], cfg.optim.betas[1]})
                              .eps(cfg.optim.eps)
                              .weight_decay(cfg.optim.weight_decay));
  MetricsWriter metrics((run_dir / "metrics.jsonl").string());
  core::Progress progress("train step", cfg.train.steps, 2.0);
  TrainSummary summary{run_dir.string(), 0, 0};
  for (int64_t step = 1; step <= cfg.train.steps; ++step) {
    core::Stopwatch sw;
    const auto batch = model->example_batch(cfg.data.batch_size);
    opt.zero_grad();
    const auto pred = model->forward(batch);
    auto loss = model->loss(batch, pred);
    const double loss_v = loss.total.item<double>();
    if (!std::isfinite(loss_v)) throw_error<NumericsError>("loss is {} at step {}", loss_v, step);
    loss.total.backward();
    double grad_norm = NAN;
    if (cfg.optim.grad_clip > 0) {
      grad_norm = torch::nn::utils::clip_grad_norm_(model->parameters(), cfg.optim.grad_clip);
    }
    opt.step();
    const double step_ms = sw.elapsed_ms();
    summary.steps = step;
    summary.final_loss = loss_v;
    if (step % cfg.train.log_every == 0 || step == cfg.train.steps) {
      metrics.write("train", step,
                    {{"loss", loss_v},
                     {"lr", cfg.optim.lr},
                     {"grad_norm", grad_norm},
                     {"step_ms", step_ms},
                     {"img_per_s", cfg.data.batch_size * 1000.0 / step_ms}});
    }
    progress.update(step, fmt::format("loss {:.4f}", loss_v));
  }
  progress.finish(fmt::format("final loss {:.4f}", summary.final_loss));
  core::log::info("metrics: {}", (run_dir / "metrics.jsonl").string());
  return summary;
}

}  // namespace parallax::train
