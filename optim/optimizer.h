// Optimizers on LibTorch kernels: AdamW (ATen's fused multi-tensor kernel `_fused_adamw_` on CPU
// and CUDA, or the reference per-tensor math) and SGD with momentum (`_fused_sgd_` or reference).
//
// The optimizer updates the tensors it was given using their `.grad()`; those tensors may be
// model parameters, or flat shards of them (ZeRO). When a parameter is stored in a low-precision
// dtype (bf16/fp16), the optimizer keeps an fp32 master copy, updates it and writes it back
// (rounded) into the parameter: updates are never lost to bf16 rounding. Gradients may be in any
// floating dtype; they are read as fp32.
//
// Thread-safety: none; call from the training thread. State tensors live on the parameters'
// device. Errors: ConfigError for an unknown optimizer name.
#pragma once

#include "optim/optim_config.h"
#include "optim/param_groups.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace parallax::optim {

class Optimizer {
 public:
  explicit Optimizer(std::vector<ParamGroup> groups);
  virtual ~Optimizer() = default;

  // One update with learning rate `lr` x the group's lr_mult for every parameter that has a
  // gradient. Parameters without a gradient (frozen, or unused with find_unused) are skipped and
  // their state untouched. Capturable mode: `lr` is ignored (see set_capturable) and the step is
  // not counted.
  void step(double lr);
  // Capturable mode (CUDA graphs, train.cuda_graph): the fused kernels read the learning rate from
  // a one-element fp32 tensor on `device` (one per distinct group lr_mult) that set_lr() writes,
  // instead of taking it as a kernel argument that a captured graph would freeze; step() does not
  // count steps, because a captured call runs no update (the caller counts what ran with
  // count_step()). Needs the fused kernels: ConfigError naming optim.fused otherwise. Call before
  // the first step.
  void set_capturable(c10::Device device);
  bool capturable() const { return !lr_tensors_.empty(); }
  // Capturable mode: the learning rate of the next step (fp32 fills on the current stream, lr x
  // each distinct lr_mult).
  void set_lr(double lr);
  void count_step() { ++steps_; }
  // Sets every gradient to None (frees memory) or zeroes it in place (`set_to_none` false; keeps
  // DDP bucket views alive).
  void zero_grad(bool set_to_none);

  const std::vector<ParamGroup>& groups() const { return groups_; }
  int64_t steps() const { return steps_; }

  // Named state for checkpoints: "<param name>.<state>", e.g. "blocks.0.fc1.weight.exp_avg",
  // "...master" (fp32 master copy when the parameter is low precision), and "step".
  std::vector<std::pair<std::string, at::Tensor>> state();
  // Restores tensors returned by state() (copied into the existing state, same shapes required).
  // Throws CheckpointError naming the missing or mismatched entry.
  void load_state(const std::map<std::string, at::Tensor>& state);

 protected:
  struct Slot {
    at::Tensor param;   // what the model sees
    at::Tensor master;  // fp32 copy if param is low precision, else == param
    std::map<std::string, at::Tensor> state;
    std::string name;
    double weight_decay = 0;
  };
  // Creates state for a slot on first use.
  virtual void init_state(Slot& slot) = 0;
  // Updates `slots` (all have grads; masters fp32) with their fp32 grads at learning rate `lr`
  // (already times the group's lr_mult). `lr_tensor` is defined in capturable mode (and then used
  // instead of `lr`; it holds the group's lr x lr_mult).
  virtual void update(std::vector<Slot*>& slots, std::vector<at::Tensor>& grads, double lr,
                      const at::Tensor& lr_tensor, double weight_decay) = 0;
  // Whether update() runs ATen's fused kernel (the only path that takes a tensor learning rate).
  virtual bool fused() const = 0;

  std::vector<ParamGroup> groups_;
  std::vector<std::vector<Slot>> slots_;  // per group
  int64_t steps_ = 0;
  // Capturable mode only: lr x lr_mult per distinct lr_mult, and each group's tensor among them.
  std::map<double, at::Tensor> lr_tensors_;
  std::vector<at::Tensor> group_lr_;
};

class AdamW : public Optimizer {
 public:
  AdamW(std::vector<ParamGroup> groups, double beta1, double beta2, double eps, bool fused);

 protected:
  void init_state(Slot& slot) override;
  void update(std::vector<Slot*>& slots, std::vector<at::Tensor>& grads, double lr,
              const at::Tensor& lr_tensor, double wd) override;
  bool fused() const override { return fused_; }

 private:
  double beta1_, beta2_, eps_;
  bool fused_;
};

class Sgd : public Optimizer {
 public:
  Sgd(std::vector<ParamGroup> groups, double momentum, bool nesterov, bool fused);

 protected:
  void init_state(Slot& slot) override;
  void update(std::vector<Slot*>& slots, std::vector<at::Tensor>& grads, double lr,
              const at::Tensor& lr_tensor, double wd) override;
  bool fused() const override { return fused_; }

 private:
  double momentum_;
  bool nesterov_, fused_;
};

// Builds the optimizer `cfg.name` over `groups`. `fused` resolves cfg.fused ("auto" = fused).
std::unique_ptr<Optimizer> build_optimizer(const OptimConfig& cfg, std::vector<ParamGroup> groups);

}  // namespace parallax::optim
