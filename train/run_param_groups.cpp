// build_run()'s parameter groups (train/run_steps.h): optim.param_groups and optim.layer_decay
// checked against the model and applied (frozen rules) before any engine exists, the start table,
// and the table's record in checkpoints with the warnings of a resume whose groups changed.
#include "checkpoint/format.h"
#include "core/error.h"
#include "core/glob.h"
#include "core/log.h"
#include "models/model.h"
#include "optim/param_groups.h"
#include "train/run_steps.h"

#include <fmt/format.h>

#include <string>
#include <vector>

namespace parallax::train::detail {

namespace {

constexpr const char* kCount = "optim.param_groups.count";
constexpr const char* kLayerDecay = "optim.layer_decay";

std::string rule_key(std::size_t i, const char* field) {
  return fmt::format("optim.param_groups.{}.{}", i, field);
}

// The rule as a checkpoint recorded it.
struct SavedRule {
  std::string match;
  double lr_mult = 1, weight_decay_mult = 1;
  bool frozen = false;
  int64_t params = 0;
};

std::vector<SavedRule> saved_rules(const checkpoint::Metadata& m) {
  std::vector<SavedRule> out;
  if (!m.has_extra(kCount)) return out;
  const int64_t n = m.extra_int(kCount);
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    SavedRule r;
    r.match = m.extra_string(rule_key(k, "match"));
    r.lr_mult = m.extra_double(rule_key(k, "lr_mult"));
    r.weight_decay_mult = m.extra_double(rule_key(k, "weight_decay_mult"));
    r.frozen = m.extra_int(rule_key(k, "frozen")) != 0;
    r.params = m.extra_int(rule_key(k, "params"));
    out.push_back(std::move(r));
  }
  return out;
}

int64_t rule_params(const Run& run, std::size_t i) {
  for (const auto& row : run.param_group_rows)
    if (row.rule == static_cast<int>(i)) return row.params;
  return 0;
}

}  // namespace

optim::LayerOf layer_of(const models::Model& model) {
  return [&model](const std::string& name) -> std::optional<optim::LayerPosition> {
    const std::optional<models::LayerDepth> d = model.layer_depth(name);
    if (!d) return std::nullopt;
    return optim::LayerPosition{d->id, d->depth};
  };
}

void apply_param_groups(Run& run, bool log) {
  run.param_group_rows.clear();
  const optim::OptimConfig& oc = run.cfg.optim;
  if (oc.param_groups.empty() && oc.layer_decay == 1.0) return;
  models::Model& model = *run.model;
  std::vector<optim::ParamShape> shapes;
  for (const auto& item : model.named_parameters()) {
    shapes.push_back(
        {item.key(), item.value().dim(), item.value().numel(), !item.value().requires_grad()});
  }
  if (oc.layer_decay != 1.0) {
    const bool layered = !shapes.empty() && model.layer_depth(shapes.front().name).has_value();
    PARALLAX_CHECK(layered, ConfigError,
                   "key 'optim.layer_decay': layer-wise lr decay needs a model with layers (a "
                   "ViT), but model '{}'{} has none; set optim.layer_decay=1",
                   run.cfg.model.name,
                   run.cfg.model.name == "bev"
                       ? fmt::format(" with backbone '{}'", run.cfg.model.backbone)
                       : std::string());
  }
  const optim::GroupSettings settings =
      optim::group_settings(oc.weight_decay, oc.param_groups, oc.layer_decay, layer_of(model));
  run.param_group_rows = optim::check_param_groups(shapes, settings);
  // Frozen before any engine is built: DDP and ZeRO then leave these parameters out exactly as
  // they leave out a LoRA base (no bucket, no gradient, no optimizer state; ZeRO-3 shards them
  // with the other frozen parameters).
  int64_t frozen = 0;
  for (auto& item : model.named_parameters()) {
    at::Tensor& p = item.value();
    if (!p.requires_grad()) continue;
    if (optim::assign_param(item.key(), p.dim(), settings).frozen) {
      p.requires_grad_(false);
      ++frozen;
    }
  }
  if (log && run.rank0) {
    core::log::info(
        "parameter groups (optim.param_groups, first matching rule decides; "
        "optim.layer_decay={:g}; "
        "{} parameter(s) frozen by the rules; lr = optim.lr x lr_mult x layer scale):\n{}",
        oc.layer_decay, frozen, optim::format_group_table(run.param_group_rows));
  }
}

void save_param_groups(const Run& run, checkpoint::SaveState& state) {
  const optim::OptimConfig& oc = run.cfg.optim;
  state.set_extra(kLayerDecay, oc.layer_decay);
  state.set_extra(kCount, static_cast<int64_t>(oc.param_groups.size()));
  for (std::size_t i = 0; i < oc.param_groups.size(); ++i) {
    const optim::ParamGroupRule& r = oc.param_groups[i];
    state.set_extra(rule_key(i, "match"), r.match);
    state.set_extra(rule_key(i, "lr_mult"), r.lr_mult);
    state.set_extra(rule_key(i, "weight_decay_mult"), r.weight_decay_mult);
    state.set_extra(rule_key(i, "frozen"), static_cast<int64_t>(r.frozen ? 1 : 0));
    state.set_extra(rule_key(i, "params"), rule_params(run, i));
  }
}

void compare_param_groups(const Run& run) {
  if (!run.rank0 || !run.resume) return;
  const checkpoint::Metadata& m = run.resume->metadata();
  if (!m.has_extra(kCount)) return;  // saved before checkpoints kept the table
  const optim::OptimConfig& oc = run.cfg.optim;
  if (m.has_extra(kLayerDecay) && m.extra_double(kLayerDecay) != oc.layer_decay) {
    core::log::warn("optim.layer_decay: {:g} in the checkpoint, {:g} now",
                    m.extra_double(kLayerDecay), oc.layer_decay);
  }
  const std::vector<SavedRule> saved = saved_rules(m);
  const std::size_t n = std::max(saved.size(), oc.param_groups.size());
  for (std::size_t i = 0; i < n; ++i) {
    if (i >= oc.param_groups.size()) {
      core::log::warn("optim.param_groups[{}] '{}': in the checkpoint, not now", i, saved[i].match);
      continue;
    }
    const optim::ParamGroupRule& now = oc.param_groups[i];
    if (i >= saved.size()) {
      core::log::warn("optim.param_groups[{}] '{}': not in the checkpoint, new now", i, now.match);
      continue;
    }
    const SavedRule& was = saved[i];
    std::vector<std::string> diffs;
    if (was.match != now.match)
      diffs.push_back(fmt::format("match '{}' in the checkpoint, '{}' now", was.match, now.match));
    if (was.lr_mult != now.lr_mult)
      diffs.push_back(
          fmt::format("lr_mult {:g} in the checkpoint, {:g} now", was.lr_mult, now.lr_mult));
    if (was.weight_decay_mult != now.weight_decay_mult) {
      diffs.push_back(fmt::format("weight_decay_mult {:g} in the checkpoint, {:g} now",
                                  was.weight_decay_mult, now.weight_decay_mult));
    }
    if (was.frozen != now.frozen) {
      diffs.push_back(fmt::format("frozen {} in the checkpoint, {} now{}", was.frozen, now.frozen,
                                  now.frozen ? " (its optimizer state in the checkpoint is skipped)"
                                             : " (its optimizer state starts fresh)"));
    }
    const int64_t params = rule_params(run, i);
    if (was.params != params) {
      diffs.push_back(fmt::format("{} parameter(s) in the checkpoint, {} now", was.params, params));
    }
    if (diffs.empty()) continue;
    std::string line;
    for (const auto& d : diffs) line += (line.empty() ? "" : "; ") + d;
    core::log::warn("optim.param_groups[{}] '{}': {}", i, now.match, line);
  }
}

bool frozen_in_checkpoint(const Run& run, const std::string& param) {
  if (!run.resume) return false;
  for (const SavedRule& r : saved_rules(run.resume->metadata())) {
    // The checkpoint's first matching rule decided, as now.
    if (core::glob_match(r.match, param)) return r.frozen;
  }
  return false;
}

}  // namespace parallax::train::detail
