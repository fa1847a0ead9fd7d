// The `optim`, `schedule` and `precision` config sections.
#pragma once

#include "core/config.h"
#include "optim/param_groups.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace parallax::optim {

struct OptimConfig {
  std::string name = "adamw";
  double lr = 1e-3;
  double weight_decay = 0.01;
  std::vector<double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double momentum = 0.9;
  bool nesterov = false;
  double grad_clip = 1.0;  // 0: off
  std::string fused = "auto";
  std::vector<ParamGroupRule> param_groups;  // optim/param_groups.h
  double layer_decay = 1.0;

  template <class V>
  void visit(V& v) {
    v("name", name, "optimizer", core::Check::one_of({"adamw", "sgd"}));
    v("lr", lr, "peak learning rate", core::Check::positive());
    v("weight_decay", weight_decay, "decoupled weight decay (not applied to norms and biases)",
      core::Check::at_least(0));
    v("betas", betas, "AdamW betas", core::Check::between(0, 1));
    v("eps", eps, "AdamW epsilon", core::Check::positive());
    v("momentum", momentum, "SGD momentum", core::Check::between(0, 1));
    v("nesterov", nesterov, "SGD Nesterov momentum");
    v("grad_clip", grad_clip, "clip the global gradient norm to this value (0: off)",
      core::Check::at_least(0));
    v("fused", fused, "fused AdamW kernel on CUDA", core::Check::one_of({"auto", "on", "off"}));
    v("param_groups", param_groups,
      "per-parameter rules {match, lr_mult, weight_decay_mult, frozen} (mmengine's "
      "paramwise_cfg); the first rule in list order whose glob matches a parameter's name "
      "decides (docs/training.md, Parameter groups)");
    core::Check in_0_1 = core::Check::positive();
    in_0_1.max = 1;
    v("layer_decay", layer_decay,
      "layer-wise lr decay of ViT fine-tuning (BEiT/MAE): layer i of a depth-d ViT trains at lr x "
      "layer_decay^(d+1-i) (embedding i=0, block b i=b+1, after the last block i=d+1), times its "
      "rule's lr_mult; 1: off",
      in_0_1);
  }
  void validate() const {
    if (betas.size() != 2)
      throw_error<ConfigError>("key 'optim.betas' needs 2 values, got {}", betas.size());
    // The range checks let `inf` through (inf > 0): a non-finite hyper-parameter turns the first
    // step's weights into NaN, so it is refused here, naming the key.
    const std::pair<const char*, double> values[] = {{"optim.lr", lr},
                                                     {"optim.weight_decay", weight_decay},
                                                     {"optim.eps", eps},
                                                     {"optim.momentum", momentum},
                                                     {"optim.grad_clip", grad_clip},
                                                     {"optim.betas[0]", betas[0]},
                                                     {"optim.betas[1]", betas[1]}};
    for (const auto& [key, v] : values) {
      if (!std::isfinite(v))
        throw_error<ConfigError>("key '{}' must be a finite number, got {}", key, v);
    }
    for (std::size_t i = 0; i < param_groups.size(); ++i) {
      const ParamGroupRule& r = param_groups[i];
      if (r.match.empty())
        throw_error<ConfigError>("key 'optim.param_groups[{}].match' must not be empty", i);
      const std::pair<const char*, double> mults[] = {{"lr_mult", r.lr_mult},
                                                      {"weight_decay_mult", r.weight_decay_mult}};
      for (const auto& [key, v] : mults) {
        if (!std::isfinite(v) || v < 0) {
          throw_error<ConfigError>(
              "key 'optim.param_groups[{}].{}' must be a finite number >= 0, got {}", i, key, v);
        }
      }
    }
  }
};

struct ScheduleConfig {
  std::string name = "cosine";
  int64_t warmup_steps = 0;
  double min_lr_ratio = 0.0;

  template <class V>
  void visit(V& v) {
    v("name", name, "LR schedule after warmup",
      core::Check::one_of({"cosine", "linear", "constant"}));
    v("warmup_steps", warmup_steps, "linear warmup steps from 0 to optim.lr",
      core::Check::at_least(0));
    v("min_lr_ratio", min_lr_ratio, "final LR as a fraction of optim.lr",
      core::Check::between(0, 1));
  }
};

// precision.fp8: how FP8 scales its tensors (kernels/fp8.h).
struct Fp8Config {
  std::string recipe = "current";
  int64_t amax_history = 16;

  template <class V>
  void visit(V& v) {
    v("recipe", recipe,
      "fp8 scaling: current (amax of the tensor being cast, torchao's default) or delayed (max "
      "over an amax history, Transformer Engine's)",
      core::Check::one_of({"current", "delayed"}));
    v("amax_history", amax_history, "fp8 delayed scaling: steps of amax history",
      core::Check::between(1, 1024));
  }
};

struct PrecisionConfig {
  std::string mode = "fp32";
  double loss_scale_init = 65536.0;
  int64_t loss_scale_growth_interval = 2000;
  double loss_scale_min = 1.0;
  Fp8Config fp8;

  template <class V>
  void visit(V& v) {
    v("mode", mode,
      "compute precision (bf16/fp16 via autocast, fp32 master weights; fp8: bf16 with the ViT "
      "blocks' linear layers on FP8 tensor cores)",
      core::Check::one_of({"fp32", "bf16", "fp16", "fp8"}));
    v("loss_scale_init", loss_scale_init, "fp16 initial loss scale", core::Check::positive());
    v("loss_scale_growth_interval", loss_scale_growth_interval,
      "fp16: double the scale after this many steps without inf/NaN", core::Check::at_least(1));
    v("loss_scale_min", loss_scale_min, "fp16: abort if the scale must fall below this",
      core::Check::positive());
    v("fp8", fp8);
  }
};

}  // namespace parallax::optim
