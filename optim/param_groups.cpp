#include "optim/param_groups.h"

#include "core/error.h"
#include "core/glob.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

namespace parallax::optim {

const std::vector<std::string>& default_no_decay_names() {
  static const std::vector<std::string> kNames = {"pos_embed", "cls_token", "reg_token",
                                                  "dist_token", "query_embed"};
  return kNames;
}

GroupSettings group_settings(double weight_decay, std::vector<ParamGroupRule> rules,
                             double layer_decay, LayerOf layer_of) {
  GroupSettings s;
  s.weight_decay = weight_decay;
  s.rules = std::move(rules);
  s.layer_decay = layer_decay;
  s.layer_of = std::move(layer_of);
  s.no_decay_names = default_no_decay_names();
  return s;
}

ParamAssignment assign_param(const std::string& name, int64_t dim, const GroupSettings& s) {
  ParamAssignment a;
  for (std::size_t i = 0; i < s.rules.size(); ++i) {
    if (core::glob_match(s.rules[i].match, name)) {
      a.rule = static_cast<int>(i);
      break;
    }
  }
  const ParamGroupRule* rule = a.rule >= 0 ? &s.rules[static_cast<std::size_t>(a.rule)] : nullptr;
  if (s.layer_decay != 1.0) {
    const std::optional<LayerPosition> pos = s.layer_of ? s.layer_of(name) : std::nullopt;
    PARALLAX_CHECK(pos.has_value(), ConfigError,
                   "key 'optim.layer_decay': parameter '{}' has no layer id (the model does not "
                   "report layers)",
                   name);
    a.layer = pos->id;
    a.layer_scale = std::pow(s.layer_decay, pos->depth + 1 - pos->id);
  }
  a.lr_mult = (rule ? rule->lr_mult : 1.0) * a.layer_scale;
  a.decays = dim > 1;
  for (const auto& n : s.no_decay_names) a.decays = a.decays && name.find(n) == std::string::npos;
  a.weight_decay = a.decays ? s.weight_decay * (rule ? rule->weight_decay_mult : 1.0) : 0.0;
  a.frozen = rule && rule->frozen;
  return a;
}

std::vector<ParamGroup> make_param_groups(const NamedParams& params, double weight_decay,
                                          const std::vector<std::string>& no_decay_names) {
  GroupSettings s;
  s.weight_decay = weight_decay;
  s.no_decay_names = no_decay_names;
  return make_param_groups(params, s);
}

std::vector<ParamGroup> make_param_groups(const NamedParams& params, const GroupSettings& s) {
  if (s.rules.empty() && s.layer_decay == 1.0) {
    // The two default groups, decay first (checkpoints, the planner and tests know this order).
    ParamGroup decay{"decay", {}, {}, s.weight_decay, 1.0};
    ParamGroup no_decay{"no_decay", {}, {}, 0.0, 1.0};
    for (const auto& [name, p] : params) {
      if (!p.requires_grad()) continue;
      ParamGroup& g = assign_param(name, p.dim(), s).decays ? decay : no_decay;
      g.names.push_back(name);
      g.params.push_back(p);
    }
    std::vector<ParamGroup> out;
    if (!decay.params.empty()) out.push_back(std::move(decay));
    if (!no_decay.params.empty()) out.push_back(std::move(no_decay));
    return out;
  }
  // (rule, lr multiplier, decays, weight decay) -> group, in order of first appearance.
  std::map<std::tuple<int, double, bool, double>, std::size_t> index;
  std::vector<ParamGroup> out;
  for (const auto& [name, p] : params) {
    if (!p.requires_grad()) continue;
    const ParamAssignment a = assign_param(name, p.dim(), s);
    if (a.frozen) continue;  // the trainer froze it already; a caller that did not: left out too
    const auto key = std::make_tuple(a.rule, a.lr_mult, a.decays, a.weight_decay);
    auto it = index.find(key);
    if (it == index.end()) {
      ParamGroup g;
      const std::string rule =
          a.rule >= 0 ? s.rules[static_cast<std::size_t>(a.rule)].match : std::string("default");
      g.name = fmt::format("{}/{}", rule, a.decays ? "decay" : "no_decay");
      if (a.layer >= 0) g.name += fmt::format("@layer{}", a.layer);
      g.weight_decay = a.weight_decay;
      g.lr_mult = a.lr_mult;
      it = index.emplace(key, out.size()).first;
      out.push_back(std::move(g));
    }
    out[it->second].names.push_back(name);
    out[it->second].params.push_back(p);
  }
  return out;
}

std::vector<GroupRow> check_param_groups(const std::vector<ParamShape>& params,
                                         const GroupSettings& s) {
  std::vector<GroupRow> rows(s.rules.size() + 1);
  for (std::size_t i = 0; i < s.rules.size(); ++i) {
    rows[i].label = s.rules[i].match;
    rows[i].rule = static_cast<int>(i);
    rows[i].frozen = s.rules[i].frozen;
  }
  rows.back().label = "(default)";
  std::vector<int64_t> matched(s.rules.size(), 0);
  int64_t trainable = 0;
  for (const auto& p : params) {
    const ParamAssignment a = assign_param(p.name, p.dim, s);
    if (a.rule >= 0) ++matched[static_cast<std::size_t>(a.rule)];
    if (p.frozen_already) continue;
    if (!a.frozen) ++trainable;
    GroupRow& r = rows[a.rule >= 0 ? static_cast<std::size_t>(a.rule) : s.rules.size()];
    if (r.params == 0) {
      r.lr_min = r.lr_max = a.lr_mult;
      r.wd_min = r.wd_max = a.weight_decay;
    }
    r.lr_min = std::min(r.lr_min, a.lr_mult);
    r.lr_max = std::max(r.lr_max, a.lr_mult);
    r.wd_min = std::min(r.wd_min, a.weight_decay);
    r.wd_max = std::max(r.wd_max, a.weight_decay);
    ++r.params;
    r.elements += p.numel;
  }
  for (std::size_t i = 0; i < s.rules.size(); ++i) {
    if (matched[i] > 0) continue;
    std::vector<std::string> some;
    for (std::size_t k = 0; k < params.size() && some.size() < 4; ++k)
      some.push_back(params[k].name);
    // The first matching rule decides: a rule whose every match an earlier one takes is as dead as
    // a typo, and named so.
    const bool shadowed = std::any_of(params.begin(), params.end(), [&](const ParamShape& p) {
      return core::glob_match(s.rules[i].match, p.name);
    });
    throw_error<ConfigError>(
        "key 'optim.param_groups[{}].match': '{}' {}; parameter names look like: {}{}", i,
        s.rules[i].match,
        shadowed ? "matches only parameters that an earlier rule already takes (the first "
                   "matching rule in list order decides)"
                 : "matches no parameter of the model",
        fmt::join(some, ", "), params.size() > some.size() ? ", ..." : "");
  }
  PARALLAX_CHECK(trainable > 0 || params.empty(), ConfigError,
                 "key 'optim.param_groups': the rules freeze every trainable parameter of the "
                 "model ({} parameters); nothing would train",
                 params.size());
  if (rows.back().params == 0) rows.pop_back();
  return rows;
}

std::string format_group_table(const std::vector<GroupRow>& rows) {
  std::string out = fmt::format("{:<4} {:<32} {:>7} {:>12}  {:<22} {}\n", "", "rule", "params",
                                "elements", "lr_mult x layer", "weight decay");
  for (const auto& r : rows) {
    const std::string idx = r.rule >= 0 ? fmt::format("[{}]", r.rule) : "";
    const auto range = [](double lo, double hi) {
      return lo == hi ? fmt::format("{:g}", lo) : fmt::format("{:g} .. {:g}", lo, hi);
    };
    out += fmt::format("{:<4} {:<32} {:>7} {:>12}  {:<22} {}\n", idx, r.label, r.params, r.elements,
                       r.frozen ? "frozen" : range(r.lr_min, r.lr_max),
                       r.frozen ? "-" : range(r.wd_min, r.wd_max));
  }
  return out;
}

}  // namespace parallax::optim
