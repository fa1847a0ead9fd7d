// Config files into a ConfigTree (config.h): the file checks, the `_base_` chain and its merge,
// where each key came from (origins), and the resolved config's YAML and hash. Overrides are
// parsed in config_override.cpp, values read into structs in config_read.cpp.
#include "core/config.h"

#include "core/strings.h"
#include "core/yaml_scan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

namespace fs = std::filesystem;

namespace parallax::core {
namespace {

constexpr const char* kBaseKey = "_base_";
constexpr const char* kDeleteKey = "_delete_";

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_error<ConfigError>("cannot read config file '{}'", clip(path, 200));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// "config file 'x'" or "a.yaml: base config 'x'": how messages about a file of the chain start.
std::string file_label(const std::string& path, const std::string& included_from) {
  if (included_from.empty()) return fmt::format("config file '{}'", clip(path, 200));
  return fmt::format("{}: base config '{}'", clip(included_from, 200), clip(path, 200));
}

[[noreturn]] void missing_file(const std::string& path, const std::string& included_from) {
  std::string hint;
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  if (fs::is_directory(dir, ec)) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const auto ext = e.path().extension().string();
      if (ext == ".yaml" || ext == ".yml") names.push_back(e.path().filename().string());
    }
    const std::string m = closest_match(p.filename().string(), names);
    // The file itself never is its own suggestion (a dangling symlink is listed but not found).
    if (!m.empty() && m != p.filename().string())
      hint = fmt::format(" (did you mean '{}'?)", (dir / m).string());
  } else {
    hint = fmt::format(" (directory '{}' does not exist)", clip(dir.string(), 200));
  }
  throw_error<ConfigError>("{} not found{}", file_label(path, included_from), hint);
}

// Throws unless `path` is a regular file (through any symlinks) small enough to be a config,
// saying what it is instead: missing, a directory, a symlink loop, a dangling symlink, a FIFO...
void check_config_file(const std::string& path, const std::string& included_from) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  const std::string what = file_label(path, included_from);
  if (ec && ec.value() == ELOOP) {
    throw_error<ConfigError>(
        "{} cannot be resolved: symlink loop (too many levels of symbolic links)", what);
  }
  if (st.type() == fs::file_type::not_found) {
    std::error_code lec;
    if (fs::is_symlink(fs::symlink_status(path, lec))) {
      throw_error<ConfigError>("{} is a dangling symlink (to '{}', which does not exist)", what,
                               clip(fs::read_symlink(path, lec).string(), 200));
    }
    missing_file(path, included_from);
  }
  if (ec) throw_error<ConfigError>("{} cannot be read: {}", what, ec.message());
  if (st.type() == fs::file_type::directory) {
    // Suggest a config inside it ("configs" -> "configs/bev_tiny.yaml").
    std::vector<std::string> yamls;
    for (const auto& e : fs::directory_iterator(path, ec)) {
      const auto ext = e.path().extension().string();
      if (ext == ".yaml" || ext == ".yml") yamls.push_back(e.path().string());
    }
    std::sort(yamls.begin(), yamls.end());
    const std::string hint =
        yamls.empty() ? std::string()
                      : fmt::format(" (pass a YAML file, e.g. '{}')", clip(yamls.front(), 200));
    throw_error<ConfigError>("{} is a directory, not a YAML file{}", what, hint);
  }
  if (st.type() != fs::file_type::regular) {
    throw_error<ConfigError>("{} is not a regular file (a FIFO, socket or device)", what);
  }
  const auto bytes = fs::file_size(path, ec);
  if (!ec && bytes > kMaxConfigFileBytes) {
    throw_error<ConfigError>("{} is {}; a config file is at most {}", what,
                             human_bytes(static_cast<double>(bytes)),
                             human_bytes(static_cast<double>(kMaxConfigFileBytes)));
  }
}

}  // namespace

YAML::Node load_yaml(const std::string& text, const std::string& name) {
  try {
    return detail::scan_and_load(text, name);
  } catch (const YAML::ParserException& e) {
    throw_error<ConfigError>("{}:{}:{}: malformed YAML: {}", name, e.mark.line + 1,
                             e.mark.column + 1, e.msg);
  }
}

namespace {

// Returns a fresh node: `over` merged onto `base` (neither input is modified or aliased).
YAML::Node merge_nodes(const YAML::Node& base, const YAML::Node& over) {
  if (over.IsMap() && base.IsMap()) {
    const YAML::Node del = over[kDeleteKey];
    if (del.IsDefined() && del.IsScalar() && del.as<std::string>() == "true") {
      YAML::Node out = YAML::Clone(over);
      out.remove(kDeleteKey);
      return out;
    }
    YAML::Node out = YAML::Clone(base);
    for (auto it = over.begin(); it != over.end(); ++it) {
      const std::string key = it->first.as<std::string>();
      const YAML::Node b = base[key];
      out[key] = b.IsDefined() ? merge_nodes(b, it->second) : YAML::Clone(it->second);
    }
    return out;
  }
  YAML::Node out = YAML::Clone(over);
  if (out.IsMap()) out.remove(kDeleteKey);
  return out;
}

}  // namespace

// ---- ConfigTree --------------------------------------------------------------------------------

ConfigTree::ConfigTree() : root_(YAML::NodeType::Map) {}

ConfigTree ConfigTree::from_node(const YAML::Node& node, const std::string& origin_label) {
  ConfigTree t;
  t.root_ = YAML::Clone(node);
  t.origins_[""] = origin_label;
  return t;
}

ConfigTree ConfigTree::from_string(const std::string& yaml, const std::string& name) {
  ConfigTree t;
  YAML::Node n = load_yaml(yaml, name);
  // An empty file is a mistake (a truncated copy, the wrong path), never a config: a file that
  // wants every default says so with `{}`.
  if (n.IsNull())
    throw_error<ConfigError>("{}: the config is empty (no keys; write '{{}}' for all defaults)",
                             name);
  if (!n.IsMap())
    throw_error<ConfigError>("{}: the config must be a mapping of sections, got {}", name,
                             detail::describe_node(n));
  t.root_ = n;
  t.record_origins(n, "", name);
  return t;
}

ConfigTree ConfigTree::from_file(const std::string& path) {
  std::vector<std::string> stack;
  return load_recursive(path, stack);
}

ConfigTree ConfigTree::load_recursive(const std::string& path, std::vector<std::string>& stack) {
  check_config_file(path, stack.empty() ? std::string() : stack.back());
  std::error_code ec;
  std::string canon = fs::weakly_canonical(path, ec).string();
  if (ec) canon = fs::absolute(path, ec).lexically_normal().string();
  if (std::find(stack.begin(), stack.end(), canon) != stack.end()) {
    std::string chain;
    for (const auto& s : stack) chain += fs::path(s).filename().string() + " -> ";
    throw_error<ConfigError>("{}: _base_ cycle: {}{}", path, chain,
                             fs::path(path).filename().string());
  }
  ConfigTree self = from_string(read_text_file(path), path);
  const YAML::Node bases = self.root_[kBaseKey];
  if (!bases.IsDefined()) return self;

  std::vector<std::string> base_files;
  if (bases.IsScalar()) {
    base_files.push_back(bases.Scalar());
  } else if (bases.IsSequence()) {
    for (const auto& b : bases) {
      if (!b.IsScalar())
        throw_error<ConfigError>("{}:{}: _base_ entries must be file names", path,
                                 b.Mark().line + 1);
      base_files.push_back(b.Scalar());
    }
  } else {
    throw_error<ConfigError>("{}:{}: _base_ must be a file name or a list of file names", path,
                             bases.Mark().line + 1);
  }
  stack.push_back(canon);
  ConfigTree merged;
  const fs::path dir = fs::path(path).parent_path();
  for (const auto& b : base_files) {
    const fs::path bp = fs::path(b).is_absolute() ? fs::path(b) : dir / b;
    merged.merge(load_recursive(bp.lexically_normal().string(), stack));
  }
  stack.pop_back();
  self.root_.remove(kBaseKey);
  merged.merge(self);
  return merged;
}

void ConfigTree::record_origins(const YAML::Node& node, const std::string& path,
                                const std::string& file) {
  const auto mark = node.Mark();
  origins_[path] = mark.line >= 0 ? fmt::format("{}:{}", file, mark.line + 1) : file;
  if (node.IsMap()) {
    for (auto it = node.begin(); it != node.end(); ++it) {
      const std::string key = it->first.Scalar();
      const std::string child = detail::child_path(path, key);
      record_origins(it->second, child, file);
      // Prefer the key's line (the value of `a:` followed by a nested map starts a line later).
      const auto kmark = it->first.Mark();
      if (kmark.line >= 0) origins_[child] = fmt::format("{}:{}", file, kmark.line + 1);
    }
  } else if (node.IsSequence()) {
    for (std::size_t i = 0; i < node.size(); ++i) {
      record_origins(node[i], path + "[" + std::to_string(i) + "]", file);
    }
  }
}

void ConfigTree::merge(const ConfigTree& over) {
  root_ = merge_nodes(root_, over.root_);
  for (const auto& [k, v] : over.origins_) {
    if (k.empty() && origins_.count("")) continue;  // keep the first root origin
    origins_[k] = v;
  }
}

std::string ConfigTree::origin(const std::string& path) const {
  if (auto it = origins_.find(path); it != origins_.end()) return it->second;
  // A key created by an override ("a.b=1" creates "a") takes the origin of what lies under it.
  if (!path.empty()) {
    for (auto it = origins_.lower_bound(path); it != origins_.end() && starts_with(it->first, path);
         ++it) {
      const char next = it->first.size() > path.size() ? it->first[path.size()] : '\0';
      if (next == '.' || next == '[') return it->second;
    }
  }
  std::string p = path;
  while (true) {
    auto it = origins_.find(p);
    if (it != origins_.end()) return it->second;
    if (p.empty()) return "";
    const auto cut = p.find_last_of(".[");
    p = cut == std::string::npos ? std::string() : p.substr(0, cut);
  }
}

std::string emit_yaml(const YAML::Node& node) {
  YAML::Emitter e;
  e.SetIndent(2);
  e.SetSeqFormat(YAML::Flow);
  e << node;
  return std::string(e.c_str()) + "\n";
}

std::string stable_hash(const std::string& text) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return fmt::format("{:016x}", h);
}

}  // namespace parallax::core
