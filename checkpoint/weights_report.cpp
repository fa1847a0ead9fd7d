// WeightsReport's renderings (checkpoint/weights.h): the one-line summary, the load table the log
// shows, and the JSON of metrics.jsonl's "load" row.
#include "checkpoint/weights.h"

#include "core/strings.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

namespace parallax::checkpoint {

namespace {

std::vector<std::string> mismatch_lines(const std::vector<ShapeMismatch>& mismatched) {
  std::vector<std::string> m;
  for (const auto& x : mismatched)
    m.push_back(fmt::format("{} {} saved vs {} in the model", x.name, x.saved, x.model));
  return m;
}

}  // namespace

std::string WeightsReport::summary() const {
  std::vector<std::string> parts{fmt::format("loaded {}", loaded.size())};
  if (!missing.empty()) parts.push_back("missing: " + core::join(missing, ", "));
  if (!unexpected.empty()) parts.push_back("unexpected: " + core::join(unexpected, ", "));
  if (!mismatched.empty())
    parts.push_back("shape mismatch: " + core::join(mismatch_lines(mismatched), ", "));
  return core::join(parts, "; ");
}

std::string WeightsReport::table(std::size_t max_names) const {
  const std::vector<std::pair<std::string, std::vector<std::string>>> kinds = {
      {"missing", missing},
      {"unexpected", unexpected},
      {"shape mismatch", mismatch_lines(mismatched)},
      {"ignored", ignored},
      {"adapted", adapted}};
  std::string out = fmt::format("  {:<15}{:>6}\n", "loaded", loaded.size());
  for (const auto& [kind, names] : kinds) out += fmt::format("  {:<15}{:>6}\n", kind, names.size());
  for (const auto& [kind, names] : kinds) {
    if (names.empty()) continue;
    out += fmt::format("  {}:\n", kind);
    for (std::size_t i = 0; i < names.size() && i < max_names; ++i)
      out += fmt::format("    {}\n", names[i]);
    if (names.size() > max_names)
      out += fmt::format("    ... and {} more\n", names.size() - max_names);
  }
  for (const std::string& n : notes) out += fmt::format("  note: {}\n", n);
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

std::string WeightsReport::json() const {
  nlohmann::json j;
  j["format"] = format;
  j["loaded"] = loaded.size();
  j["missing"] = missing;
  j["unexpected"] = unexpected;
  j["shape_mismatch"] = mismatch_lines(mismatched);
  j["ignored"] = ignored;
  j["adapted"] = adapted;
  j["notes"] = notes;
  return j.dump();
}

}  // namespace parallax::checkpoint
