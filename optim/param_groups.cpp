#include "optim/param_groups.h"

namespace parallax::optim {

const std::vector<std::string>& default_no_decay_names() {
  static const std::vector<std::string> kNames = {"pos_embed", "cls_token", "dist_token",
                                                  "query_embed"};
  return kNames;
}

std::vector<ParamGroup> make_param_groups(const NamedParams& params, double weight_decay,
                                          const std::vector<std::string>& no_decay_names) {
  ParamGroup decay{"decay", {}, {}, weight_decay};
  ParamGroup no_decay{"no_decay", {}, {}, 0.0};
  for (const auto& [name, p] : params) {
    if (!p.requires_grad()) continue;
    bool skip = p.dim() <= 1;
    for (const auto& n : no_decay_names) skip = skip || name.find(n) != std::string::npos;
    ParamGroup& g = skip ? no_decay : decay;
    g.names.push_back(name);
    g.params.push_back(p);
  }
  std::vector<ParamGroup> out;
  if (!decay.params.empty()) out.push_back(std::move(decay));
  if (!no_decay.params.empty()) out.push_back(std::move(no_decay));
  return out;
}

}  // namespace parallax::optim
