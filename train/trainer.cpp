// The trainer's API (train/trainer.h): a run assembled for training (train/run.h), then the loop
// (train/loop.h).
#include "train/trainer.h"

#include "train/loop.h"
#include "train/run.h"

namespace parallax::train {

struct Trainer::Impl {
  Impl(RunConfig& c, TrainerHooks h) : cfg(c), hooks(std::move(h)) {}
  RunConfig& cfg;
  TrainerHooks hooks;
  // The run lives as long as the Trainer: its model, engine and communicators stay what fit()
  // trained until the Trainer is destroyed.
  std::unique_ptr<Run> run;
};

Trainer::Trainer(RunConfig& cfg, TrainerHooks hooks)
    : impl_(std::make_unique<Impl>(cfg, std::move(hooks))) {}

Trainer::~Trainer() = default;

TrainSummary Trainer::fit() {
  RunOptions options;
  options.hooks = std::move(impl_->hooks);
  impl_->run = build_run(impl_->cfg, Purpose::kTrain, std::move(options));
  return detail::Loop(*impl_->run).fit();
}

TrainSummary run_training(RunConfig& cfg) {
  // The LoRA, distillation and QAT trainers are the plain one with their extension's hooks
  // (train/extension.h).
  const std::unique_ptr<Run> run = build_run(cfg, Purpose::kTrain);
  return detail::Loop(*run).fit();
}

}  // namespace parallax::train
