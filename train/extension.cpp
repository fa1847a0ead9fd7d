// The extension interface's defaults and the registry's checks (train/extension.h); the list of
// extensions is train/extensions.cpp.
#include "train/extension.h"

#include "core/error.h"
#include "core/strings.h"
#include "train/run_config.h"

namespace parallax::train {

std::shared_ptr<models::Model> Extension::restore(const RunConfig&, const core::SceneSpec&,
                                                  const std::string&, std::string&) const {
  return nullptr;
}

void Extension::transform_shape_only(models::Model&, const RunConfig&, int) const {}

std::vector<ConfigSection> registered_sections() {
  std::vector<ConfigSection> sections;
  for (const Extension* e : extensions()) sections.push_back(e->section());
  return sections;
}

const Extension* active_extension(const RunConfig& cfg) {
  std::vector<const Extension*> on;
  for (const Extension* e : extensions()) {
    if (e->enabled(cfg)) on.push_back(e);
  }
  if (on.size() > 1) {
    std::vector<std::string> keys, titles, values;
    for (const Extension* e : on) {
      keys.push_back(fmt::format("'{}'", e->key()));
      titles.push_back(e->title());
      values.push_back(e->key_value(cfg));
    }
    const auto listed = [](const std::vector<std::string>& v) {
      return core::join(std::vector<std::string>(v.begin(), v.end() - 1), ", ") + " and " +
             v.back();
    };
    throw_error<ConfigError>(
        "keys {}: {} are separate trainers in this version; set one of them ({})", listed(keys),
        listed(titles), core::join(values, ", "));
  }
  return on.empty() ? nullptr : on.front();
}

parallel::Plan::Transforms plan_transforms(const RunConfig& cfg) {
  parallel::Plan::Transforms t;
  if (const Extension* e = active_extension(cfg)) e->plan_transforms(t);
  return t;
}

}  // namespace parallax::train
