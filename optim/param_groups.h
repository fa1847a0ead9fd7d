// Parameter groups: which parameters get weight decay, and at what learning rate each trains.
//
// Weight decay follows timm, Megatron and nanoGPT: biases, normalisation weights and every other
// 1-D parameter, plus embeddings named in `no_decay_names` (position embeddings, class tokens),
// get no weight decay. Frozen parameters (requires_grad false, e.g. a LoRA base, or a rule's
// `frozen: true` applied by the trainer before any engine is built) are left out.
//
// On top of that, the config's `optim.param_groups` rules (mmengine's paramwise_cfg) and
// `optim.layer_decay` (BEiT/MAE fine-tuning) give each parameter a learning-rate multiplier and a
// weight-decay multiplier:
//   - the FIRST rule in list order whose glob (core::glob_match, '*' crosses dots) matches the
//     parameter's name decides; a parameter no rule matches keeps lr_mult 1, weight_decay_mult 1;
//   - layer decay: a parameter at layer id i of a model with `depth` blocks (LayerPosition, which
//     the model gives: optim cannot know a model's names) trains at lr * layer_decay^(depth+1-i),
//     times its rule's lr_mult;
//   - weight_decay_mult scales only the decay of parameters that decay (never a norm or bias).
// Parameters with equal (lr multiplier, weight decay, rule) share one group.
//
// Errors: ConfigError naming `optim.param_groups[i].match` for a rule that matches no parameter.
#pragma once

#include "core/config.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace parallax::optim {

struct ParamGroup {
  std::string name;                // "decay" | "no_decay" | "<rule>/decay[@layer i]" (a label)
  std::vector<std::string> names;  // module paths, parallel to `params`
  std::vector<at::Tensor> params;
  double weight_decay = 0;  // the effective decay (base * weight_decay_mult, or 0)
  double lr_mult = 1;       // the step's lr is lr * lr_mult (rule lr_mult x layer scale)
};

using NamedParams = std::vector<std::pair<std::string, at::Tensor>>;

// One entry of `optim.param_groups`.
struct ParamGroupRule {
  std::string match;
  double lr_mult = 1.0;
  double weight_decay_mult = 1.0;
  bool frozen = false;

  template <class V>
  void visit(V& v) {
    v("match", match,
      "glob over parameter names ('*' crosses dots, e.g. 'encoder.*' or "
      "'encoder.vit.block0.*'); the first rule in list order that matches a parameter decides; a "
      "rule that matches no parameter is an error");
    v("lr_mult", lr_mult, "learning-rate multiplier of the matched parameters",
      core::Check::at_least(0));
    v("weight_decay_mult", weight_decay_mult,
      "multiplier of optim.weight_decay for the matched parameters that decay (norms, biases and "
      "embeddings never decay)",
      core::Check::at_least(0));
    v("frozen", frozen, "freeze the matched parameters (no gradient, no optimizer state)");
  }
};

// Where a parameter sits in a layered model (models::Model::layer_depth): layer `id` in
// [0, depth + 1] (0: the embedding, i + 1: block i, depth + 1: everything after the last block).
struct LayerPosition {
  int id = 0;
  int depth = 0;
};
// The model's answer for one parameter name; nullopt: the model has no layers.
using LayerOf = std::function<std::optional<LayerPosition>(const std::string&)>;

// Everything that decides a parameter's group.
struct GroupSettings {
  double weight_decay = 0;
  std::vector<ParamGroupRule> rules;
  double layer_decay = 1.0;  // 1: off
  LayerOf layer_of;          // required when layer_decay != 1
  std::vector<std::string> no_decay_names;
};

// What GroupSettings decide for one parameter.
struct ParamAssignment {
  int rule = -1;   // index into rules; -1: no rule matched
  int layer = -1;  // layer id under layer decay; -1: off
  double layer_scale = 1.0;
  double lr_mult = 1.0;  // rule lr_mult x layer_scale
  bool decays = false;
  double weight_decay = 0;
  bool frozen = false;
};

// Substrings of parameter names that never decay, besides 1-D tensors.
const std::vector<std::string>& default_no_decay_names();

// The settings of `optim.weight_decay`, `optim.param_groups` and `optim.layer_decay` (passed in:
// param_groups.h cannot include optim_config.h, which includes it) with the default no-decay names.
GroupSettings group_settings(double weight_decay, std::vector<ParamGroupRule> rules,
                             double layer_decay, LayerOf layer_of);

// The decision for the parameter `name` of `dim` dimensions.
ParamAssignment assign_param(const std::string& name, int64_t dim, const GroupSettings& s);

// Two groups ("decay", "no_decay"), empty ones dropped; order of parameters preserved.
std::vector<ParamGroup> make_param_groups(
    const NamedParams& params, double weight_decay,
    const std::vector<std::string>& no_decay_names = default_no_decay_names());
// The groups `s` decides over the trainable parameters of `params`: without rules and layer decay
// exactly the two groups above; otherwise one group per distinct (rule, lr multiplier, decay), in
// order of first appearance.
std::vector<ParamGroup> make_param_groups(const NamedParams& params, const GroupSettings& s);

// One row of the start-up table (and of the checkpoint's record): a rule (or "(default)", the
// parameters no rule matched), its parameters and elements, the range of lr multipliers (rule
// lr_mult x layer scale) and of weight decays over them.
struct GroupRow {
  std::string label;  // the rule's match, or "(default)"
  int rule = -1;
  bool frozen = false;
  int64_t params = 0, elements = 0;
  double lr_min = 0, lr_max = 0, wd_min = 0, wd_max = 0;
};

// A parameter as check_param_groups sees it: name, dimensions, elements, and whether something
// other than the rules froze it (a LoRA base: counted in no row).
struct ParamShape {
  std::string name;
  int64_t dim = 0;
  int64_t numel = 0;
  bool frozen_already = false;
};

// Checks `s.rules` against every parameter of the model (before any pipeline or engine split):
// ConfigError naming `optim.param_groups[i].match` for a rule that decides no parameter (matches
// none, or only parameters an earlier rule takes), and naming `optim.param_groups` when the rules
// freeze every parameter that would train. Returns the table's rows: the rules in order, then
// "(default)" (the parameters no rule matched) when it has any.
std::vector<GroupRow> check_param_groups(const std::vector<ParamShape>& params,
                                         const GroupSettings& s);

// The table as text, one line per row, with a header.
std::string format_group_table(const std::vector<GroupRow>& rows);

}  // namespace parallax::optim
