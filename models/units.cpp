#include "core/error.h"
#include "models/model.h"

#include <algorithm>
#include <cctype>

namespace parallax::models {

namespace {

// `name` is `path` or lies under it ("a.b" covers "a.b" and "a.b.c", not "a.bc").
bool under(const std::string& name, const std::string& path) {
  return name.size() >= path.size() && name.compare(0, path.size(), path) == 0 &&
         (name.size() == path.size() || name[path.size()] == '.');
}

}  // namespace

std::vector<Unit> resolve_units(const torch::nn::Module& module,
                                const std::vector<UnitPaths>& specs) {
  std::vector<Unit> units;
  units.reserve(specs.size());
  for (const auto& s : specs) {
    PARALLAX_CHECK(
        std::none_of(units.begin(), units.end(), [&](const Unit& u) { return u.name == s.name; }),
        Error, "model units: two units are named '{}'", s.name);
    units.push_back({s.name, {}});
  }
  for (const auto& item : module.named_parameters()) {
    const std::string& name = item.key();
    if (under(name, kAuxModule) && !specs.empty()) {
      // Training-only modules (models/model.h, kAuxModule) join the last unit.
      units.back().param_names.push_back(name);
      continue;
    }
    int owner = -1;
    for (std::size_t u = 0; u < specs.size(); ++u) {
      if (std::none_of(specs[u].paths.begin(), specs[u].paths.end(),
                       [&](const std::string& p) { return under(name, p); })) {
        continue;
      }
      PARALLAX_CHECK(owner < 0, Error, "model units: parameter '{}' is in two units, '{}' and '{}'",
                     name, specs[owner].name, specs[u].name);
      owner = static_cast<int>(u);
    }
    PARALLAX_CHECK(owner >= 0, Error, "model units: parameter '{}' is in no unit", name);
    units[owner].param_names.push_back(name);
  }
  for (const auto& u : units) {
    PARALLAX_CHECK(!u.param_names.empty(), Error, "model units: unit '{}' owns no parameter",
                   u.name);
  }
  return units;
}

std::vector<Unit> Model::units() const {
  std::vector<Unit> all{{"model", {}}};
  for (const auto& item : named_parameters()) all[0].param_names.push_back(item.key());
  return all;
}

std::vector<at::Tensor> Model::run_unit(int index,
                                        const std::function<std::vector<at::Tensor>()>& fn) {
  if (unit_hooks_ == nullptr) return fn();
  unit_hooks_->before_unit(index);
  std::vector<at::Tensor> outputs = fn();
  unit_hooks_->after_unit(index, outputs);
  return outputs;
}

namespace {
[[noreturn]] void not_chainable() {
  throw_error<Error>(
      "pipeline: this model does not expose its forward as a chain of units (Model::chain_unit); "
      "it cannot be split into pipeline stages");
}
}  // namespace

std::vector<at::Tensor> Model::chain_begin(const core::TensorDict&) {
  not_chainable();
}
std::vector<at::Tensor> Model::chain_unit(int, const core::TensorDict&,
                                          const std::vector<at::Tensor>&) {
  not_chainable();
}
core::TensorDict Model::chain_end(const core::TensorDict&, const std::vector<at::Tensor>&) {
  not_chainable();
}

std::vector<at::Tensor> Model::run_chain(int first, int last, const core::TensorDict& batch,
                                         std::vector<at::Tensor> in) {
  PARALLAX_CHECK(0 <= first && first <= last && last <= chain_length(), Error,
                 "pipeline: units [{}, {}) are not a run of this model's {} units", first, last,
                 chain_length());
  for (int i = first; i < last; ++i) {
    if (unit_hooks_ == nullptr) {
      in = chain_unit(i, batch, in);
    } else {
      in = run_unit(i, [&] { return chain_unit(i, batch, in); });
    }
  }
  return in;
}

LayerDepth vit_layer_depth(const std::string& name, const std::string& vit_prefix, int depth) {
  const LayerDepth after{depth + 1, depth};
  if (name.compare(0, vit_prefix.size(), vit_prefix) != 0) return after;
  const std::string rest = name.substr(vit_prefix.size());
  if (rest.compare(0, 5, "norm.") == 0) return after;
  if (rest.compare(0, 5, "block") == 0) {
    std::size_t i = 5;
    int block = 0;
    while (i < rest.size() && std::isdigit(static_cast<unsigned char>(rest[i]))) {
      block = block * 10 + (rest[i] - '0');
      ++i;
    }
    if (i > 5 && i < rest.size() && rest[i] == '.') return {block + 1, depth};
  }
  return {0, depth};  // patch_embed, pos_embed, cls_token, reg_token, ...
}

}  // namespace parallax::models
