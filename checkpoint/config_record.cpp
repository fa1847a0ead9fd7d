#include "checkpoint/config_record.h"

#include "checkpoint/files.h"
#include "checkpoint/format.h"
#include "core/error.h"
#include "core/strings.h"

#include <yaml-cpp/yaml.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>

namespace fs = std::filesystem;

namespace parallax::checkpoint {
namespace {

constexpr const char* kAbsent = "(absent)";

// A number in its shortest round-trip form (the resolved YAML writes 17 significant digits:
// 0.0030000000000000001 is 0.003), anything else as written.
std::string scalar_text(const std::string& s) {
  const bool numeric =
      !s.empty() && (std::isdigit(static_cast<unsigned char>(s[0])) ||
                     ((s[0] == '-' || s[0] == '+' || s[0] == '.') && s.size() > 1));
  if (numeric && s.find_first_of(".eE") != std::string::npos) {
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    if (end == s.c_str() + s.size()) return fmt::format("{}", v);
  }
  return s;
}

std::string flow_text(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "null";
  if (n.IsScalar()) return scalar_text(n.Scalar());
  if (n.IsSequence()) {
    std::vector<std::string> items;
    for (const auto& e : n) items.push_back(flow_text(e));
    std::string out = "[";
    out += core::join(items, ", ");
    out += ']';
    return out;
  }
  YAML::Emitter out;
  out << YAML::Flow << n;
  return out.c_str();
}

// Leaves of `n` as (dotted key, flow text), maps descended into, lists kept whole.
void flatten(const YAML::Node& n, const std::string& prefix,
             std::vector<std::pair<std::string, std::string>>& out) {
  if (n.IsMap()) {
    for (const auto& kv : n) {
      const std::string k = kv.first.Scalar();
      flatten(kv.second, prefix.empty() ? k : prefix + "." + k, out);
    }
    return;
  }
  out.emplace_back(prefix, flow_text(n));
}

std::vector<std::pair<std::string, std::string>> leaves(const std::string& text,
                                                        const std::string& name) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw_error<CheckpointError>("{} is not valid YAML (line {}): {}", name, e.mark.line + 1,
                                 e.msg);
  }
  if (!root.IsMap()) throw_error<CheckpointError>("{} is not a YAML map of config sections", name);
  std::vector<std::pair<std::string, std::string>> out;
  flatten(root, "", out);
  return out;
}

bool ignored(const std::string& key, const std::vector<std::string>& ignore) {
  for (const std::string& i : ignore) {
    if (key == i || core::starts_with(key, i + ".")) return true;
  }
  return false;
}

}  // namespace

std::vector<ConfigChange> diff_configs(const std::string& before, const std::string& after,
                                       const std::vector<std::string>& ignore,
                                       const std::string& before_name,
                                       const std::string& after_name) {
  const auto a = leaves(before, before_name);
  const auto b = leaves(after, after_name);
  std::map<std::string, std::string> old_values(a.begin(), a.end());
  std::set<std::string> seen;
  std::vector<ConfigChange> out;
  for (const auto& [k, v] : b) {
    seen.insert(k);
    if (ignored(k, ignore)) continue;
    const auto it = old_values.find(k);
    const std::string old = it == old_values.end() ? kAbsent : it->second;
    if (old != v) out.push_back({k, old, v});
  }
  for (const auto& [k, v] : a) {
    if (!seen.count(k) && !ignored(k, ignore)) out.push_back({k, v, kAbsent});
  }
  return out;
}

std::string describe_changes(const std::vector<ConfigChange>& changes) {
  std::vector<std::string> parts;
  for (const auto& c : changes) parts.push_back(c.key + ": " + c.before + " -> " + c.after);
  return core::join(parts, ", ");
}

std::vector<ConfigChange> changes_under(const std::vector<ConfigChange>& changes,
                                        const std::vector<std::string>& prefixes) {
  std::vector<ConfigChange> out;
  for (const auto& c : changes) {
    for (const std::string& p : prefixes) {
      if (core::starts_with(c.key, p)) {
        out.push_back(c);
        break;
      }
    }
  }
  return out;
}

std::string record_config(const std::string& run_dir, const std::string& text, int64_t step) {
  const fs::path current = fs::path(run_dir) / "config.yaml";
  std::string archived;
  if (files::file_size(current.string()) >= 0) {
    if (files::read_text(current.string()) == text) return "";
    const fs::path history = fs::path(run_dir) / kConfigHistoryDir;
    std::error_code ec;
    fs::create_directories(history, ec);
    if (ec) throw_error<IoError>("cannot create '{}': {}", history.string(), ec.message());
    const std::string base = step_dir_name(step);
    fs::path to = history / (base + ".yaml");
    for (int n = 1; fs::exists(to, ec); ++n) to = history / fmt::format("{}-{}.yaml", base, n);
    // Durable copy first, then the atomic replacement: a kill leaves the old config in place (and
    // perhaps its copy in the history), never no config.
    files::write_durable(to.string(), files::read_text(current.string()));
    files::fsync_path(history.string(), true);
    archived = to.string();
  }
  files::write_atomic(current.string(), text);
  return archived;
}

}  // namespace parallax::checkpoint
