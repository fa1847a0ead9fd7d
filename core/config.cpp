#include "core/config.h"

#include "core/strings.h"
#include "core/yaml_scan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
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

bool is_identifier(const std::string& s) {
  if (s.empty() || !(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  return std::all_of(s.begin(), s.end(),
                     [](unsigned char c) { return std::isalnum(c) || c == '_' || c == '-'; });
}

bool is_index(const std::string& s) {
  return !s.empty() &&
         std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
}

// "a.b[2].c" / "a.b.2.c" -> {"a", "b", "2", "c"}; throws on malformed keys.
std::vector<std::string> parse_key_path(const std::string& key, const std::string& expr) {
  std::vector<std::string> out;
  for (const std::string& raw : split(key, '.')) {
    std::string part = raw;
    std::vector<std::string> indices;
    while (!part.empty() && part.back() == ']') {
      const auto open = part.rfind('[');
      if (open == std::string::npos) break;
      indices.insert(indices.begin(), part.substr(open + 1, part.size() - open - 2));
      part = part.substr(0, open);
    }
    if (!(is_identifier(part) || (is_index(part) && part.size() <= 9))) {
      throw_error<ConfigError>(
          "command-line override '{}': malformed key '{}' (expected a.b.c or a.b[2])", clip(expr),
          clip(key));
    }
    out.push_back(part);
    for (const auto& i : indices) {
      if (!is_index(i)) {
        throw_error<ConfigError>("command-line override '{}': list index '{}' is not a number",
                                 clip(expr), clip(i));
      }
      if (i.size() > 9) {
        throw_error<ConfigError>("command-line override '{}': list index '{}' is too large",
                                 clip(expr), clip(i));
      }
      out.push_back(i);
    }
  }
  return out;
}

std::string format_path(const std::vector<std::string>& parts, std::size_t n) {
  std::string out;
  for (std::size_t i = 0; i < n; ++i) {
    if (is_index(parts[i])) {
      out += "[" + parts[i] + "]";
    } else {
      if (!out.empty()) out += ".";
      out += parts[i];
    }
  }
  return out;
}

// `~a.b` (parsed into `parts`) must name a key of the schema (`known`: its leaf paths) or a
// section holding some; one list element cannot be restored on its own.
void check_restorable(const std::vector<std::string>& parts, const std::vector<std::string>& known,
                      const std::string& label) {
  const std::string full = format_path(parts, parts.size());
  const auto is_known = [&](const std::string& p) {
    return std::any_of(known.begin(), known.end(), [&](const std::string& k) {
      return k == p || (starts_with(k, p) && k.size() > p.size() && k[p.size()] == '.');
    });
  };
  if (is_known(full)) return;
  const auto first_index =
      std::find_if(parts.begin(), parts.end(), [](const std::string& x) { return is_index(x); });
  if (first_index != parts.end()) {
    const std::string list =
        format_path(parts, static_cast<std::size_t>(first_index - parts.begin()));
    if (is_known(list)) {
      throw_error<ConfigError>(
          "{}: '~' restores a whole key to its default, not one element of list '{}'; "
          "write '~{}'",
          label, list, list);
    }
  }
  // Did-you-mean among the keys and sections next to it, then in other sections.
  const std::string parent = format_path(parts, parts.size() - 1);
  std::vector<std::string> siblings;
  for (const auto& k : known) {
    if (!parent.empty() &&
        !(starts_with(k, parent) && k.size() > parent.size() && k[parent.size()] == '.'))
      continue;
    const std::string rest = parent.empty() ? k : k.substr(parent.size() + 1);
    const std::string name = rest.substr(0, rest.find('.'));
    if (std::find(siblings.begin(), siblings.end(), name) == siblings.end())
      siblings.push_back(name);
  }
  throw_error<ConfigError>("{}: unknown key '{}'{}", label, clip(full),
                           detail::unknown_key_hint(parent, parts.back(), siblings, known));
}

std::string describe(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "null";
  if (n.IsScalar()) return fmt::format("'{}'", clip(n.Scalar()));
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  return "?";
}

std::string scalar_or_fail(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                           const char* expected) {
  if (!n.IsScalar())
    detail::fail_at(t, path, fmt::format("expects {}, got {}", expected, describe(n)));
  return n.Scalar();
}

template <class Int>
Int parse_int(const YAML::Node& n, const std::string& path, const ConfigTree& t) {
  const std::string s = trim(scalar_or_fail(n, path, t, "an integer"));
  constexpr Int kMin = std::numeric_limits<Int>::min(), kMax = std::numeric_limits<Int>::max();
  // Names the key's own width: an int key overflows at 2^31, an int64_t one at 2^63 (issue 35).
  const auto out_of_range = [&] {
    detail::fail_at(t, path,
                    fmt::format("value '{}' is out of range for a {}-bit integer ({}..{})", clip(s),
                                8 * sizeof(Int), kMin, kMax));
  };
  Int v{};
  const char* b = s.data();
  const char* e = s.data() + s.size();
  if (b != e && *b == '+') ++b;
  auto [ptr, ec] = std::from_chars(b, e, v);
  if (ec == std::errc::result_out_of_range && ptr == e) out_of_range();
  if (ec != std::errc() || ptr != e || b == e) {
    // Accept integral floats written in scientific notation ("1e6") since YAML users write them.
    char* end = nullptr;
    errno = 0;
    const double d = std::strtod(s.c_str(), &end);
    const bool number = end && *end == '\0' && !s.empty();
    if (number && std::isinf(d) && errno == ERANGE) out_of_range();  // "1e999"
    if (number && std::isfinite(d) && d == std::floor(d)) {
      // [kMin, kMax + 1): both bounds are powers of two, exact in a double.
      if (d < static_cast<double>(kMin) || d >= static_cast<double>(kMax) + 1.0) out_of_range();
      if (std::fabs(d) < 9.0e15) return static_cast<Int>(d);
      detail::fail_at(t, path,
                      fmt::format("'{}' is not exact as a floating-point number; write the "
                                  "integer's digits",
                                  clip(s)));
    }
    detail::fail_at(t, path, fmt::format("expects an integer, got '{}'", clip(s)));
  }
  return v;
}

double parse_double(const YAML::Node& n, const std::string& path, const ConfigTree& t) {
  std::string s = trim(scalar_or_fail(n, path, t, "a number"));
  std::string lower = s;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  if (lower == ".inf" || lower == "inf" || lower == "+.inf") return INFINITY;
  if (lower == "-.inf" || lower == "-inf") return -INFINITY;
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (s.empty() || !end || *end != '\0' || lower.find("nan") != std::string::npos ||
      lower.find("0x") != std::string::npos) {
    detail::fail_at(t, path, fmt::format("expects a number, got '{}'", clip(s)));
  }
  return d;
}

template <class T, class F>
void read_list(const YAML::Node& n, const std::string& path, const ConfigTree& t,
               std::vector<T>& out, const char* what, F&& one) {
  if (!n.IsSequence())
    detail::fail_at(t, path, fmt::format("expects a list of {}, got {}", what, describe(n)));
  std::vector<T> v;
  for (std::size_t i = 0; i < n.size(); ++i)
    v.push_back(one(n[i], path + "[" + std::to_string(i) + "]"));
  out = std::move(v);
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
                             describe(n));
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

void ConfigTree::apply_overrides(const std::vector<std::string>& exprs,
                                 const std::vector<std::string>& known_paths) {
  for (const auto& e : exprs) apply_override(e, known_paths);
}

void ConfigTree::apply_override(const std::string& expr_in,
                                const std::vector<std::string>& known_paths) {
  std::string expr = trim(expr_in);
  const std::string label = fmt::format("command-line override '{}'", clip(expr));
  if (starts_with(expr, "~")) {
    const auto parts = parse_key_path(expr.substr(1), expr);
    if (!known_paths.empty()) check_restorable(parts, known_paths, label);
    YAML::Node cur = root_;
    for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
      const YAML::Node next =
          is_index(parts[i]) && cur.IsSequence() ? cur[std::stoul(parts[i])] : cur[parts[i]];
      if (!next.IsDefined()) return;  // nothing to delete
      cur.reset(next);
    }
    if (cur.IsMap()) cur.remove(parts.back());
    return;
  }
  const auto eq = expr.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw_error<ConfigError>("{}: expected key=value (e.g. optim.lr=3e-4)", label);
  }
  std::string key = trim(expr.substr(0, eq));
  // Hydra's `+key=v` (add) and `++key=v` (add or override) behave like `key=v` here: the schema,
  // not the file, decides which keys exist.
  while (starts_with(key, "+")) key = key.substr(1);
  const std::string value_text = expr.substr(eq + 1);
  YAML::Node value;
  if (trim(value_text).empty()) {
    value = YAML::Node(std::string());
  } else {
    try {
      // The same hostile-input scan as a file's: a value may hold an alias bomb too.
      value = detail::scan_and_load(value_text, label);
    } catch (const YAML::ParserException& e) {
      throw_error<ConfigError>("{}: value '{}' is not valid YAML: {}", label, clip(value_text),
                               e.msg);
    }
  }
  const auto parts = parse_key_path(key, expr);
  YAML::Node cur = root_;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const bool last = i + 1 == parts.size();
    const std::string& part = parts[i];
    if (is_index(part) && cur.IsSequence()) {
      const std::size_t idx = std::stoul(part);
      if (idx > cur.size() || (idx == cur.size() && !last)) {
        throw_error<ConfigError>("{}: index {} is out of range for list '{}' of {} elements", label,
                                 idx, clip(format_path(parts, i)), cur.size());
      }
      if (last) {
        if (idx == cur.size())
          cur.push_back(value);  // a[n]=v appends, as in Hydra's +a=[...]
        else
          cur[idx] = value;
      } else {
        YAML::Node next = cur[idx];
        cur.reset(next);
      }
    } else {
      if (!cur.IsMap() && !cur.IsNull()) {
        throw_error<ConfigError>("{}: '{}' is {}, not a section", label,
                                 clip(format_path(parts, i)), describe(cur));
      }
      if (last) {
        cur[part] = value;
      } else {
        YAML::Node next = cur[part];
        if (!next.IsDefined() || next.IsNull()) {
          cur[part] = YAML::Node(YAML::NodeType::Map);
          next = cur[part];
        }
        cur.reset(next);
      }
    }
  }
  // Record the override as the origin of the key and of everything under it.
  const std::string path = format_path(parts, parts.size());
  for (auto it = origins_.begin(); it != origins_.end();) {
    if (it->first == path || starts_with(it->first, path + ".") ||
        starts_with(it->first, path + "[")) {
      it = origins_.erase(it);
    } else {
      ++it;
    }
  }
  origins_[path] = label;
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

// ---- reading -----------------------------------------------------------------------------------

namespace detail {

std::string child_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

void fail_at(const ConfigTree& tree, const std::string& path, const std::string& what) {
  const std::string origin = tree.origin(path);
  const std::string where = origin.empty() || origin == "default" ? "config" : origin;
  if (path.empty()) throw ConfigError(fmt::format("{}: {}", where, what));
  throw ConfigError(fmt::format("{}: key '{}' {}", where, path, what));
}

void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t, bool& out) {
  std::string s = trim(scalar_or_fail(n, path, t, "a boolean"));
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "true" || s == "yes" || s == "on" || s == "1") {
    out = true;
  } else if (s == "false" || s == "no" || s == "off" || s == "0") {
    out = false;
  } else {
    fail_at(t, path, fmt::format("expects a boolean (true/false), got '{}'", clip(n.Scalar())));
  }
}

void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t, int& out) {
  out = parse_int<int>(n, path, t);
}
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t, int64_t& out) {
  out = parse_int<int64_t>(n, path, t);
}
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t, double& out) {
  out = parse_double(n, path, t);
}
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                std::string& out) {
  if (n.IsNull()) {
    out.clear();
    return;
  }
  out = scalar_or_fail(n, path, t, "a string");
}
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                std::vector<int>& out) {
  read_list(n, path, t, out, "integers",
            [&](const YAML::Node& e, const std::string& p) { return parse_int<int>(e, p, t); });
}
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                std::vector<int64_t>& out) {
  read_list(n, path, t, out, "integers",
            [&](const YAML::Node& e, const std::string& p) { return parse_int<int64_t>(e, p, t); });
}
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                std::vector<double>& out) {
  read_list(n, path, t, out, "numbers",
            [&](const YAML::Node& e, const std::string& p) { return parse_double(e, p, t); });
}
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                std::vector<std::string>& out) {
  read_list(n, path, t, out, "strings", [&](const YAML::Node& e, const std::string& p) {
    return scalar_or_fail(e, p, t, "a string");
  });
}

void check_value(const Check& c, const std::string& path, const ConfigTree& t, double v) {
  if (c.min && (c.exclusive_min ? !(v > *c.min) : !(v >= *c.min))) {
    fail_at(t, path, fmt::format("must be {} {}, got {}", c.exclusive_min ? ">" : ">=", *c.min, v));
  }
  if (c.max && !(v <= *c.max)) fail_at(t, path, fmt::format("must be <= {}, got {}", *c.max, v));
}

void check_value(const Check& c, const std::string& path, const ConfigTree& t,
                 const std::string& v) {
  if (c.one_component) {
    const std::string why = path_component_problem(v);
    if (!why.empty()) {
      fail_at(t, path, fmt::format("must be one folder name, got '{}', which {}", clip(v), why));
    }
  }
  if (c.choices.empty() || std::find(c.choices.begin(), c.choices.end(), v) != c.choices.end())
    return;
  fail_at(t, path,
          fmt::format("must be one of {}, got '{}'{}", join(c.choices, "|"), clip(v),
                      did_you_mean(v, c.choices)));
}

std::string unknown_key_hint(const std::string& path, const std::string& key,
                             const std::vector<std::string>& siblings,
                             const std::vector<std::string>& all_paths) {
  const std::string sibling = closest_match(key, siblings);
  if (!sibling.empty()) return fmt::format(" (did you mean '{}'?)", child_path(path, sibling));
  // The key may exist in another section ("train.lr" for "optim.lr").
  for (const auto& p : all_paths) {
    const auto dot = p.rfind('.');
    const std::string leaf = dot == std::string::npos ? p : p.substr(dot + 1);
    if (leaf == key || edit_distance(leaf, key) <= 1)
      return fmt::format(" (did you mean '{}'?)", p);
  }
  return "";
}

void reject_unknown(const YAML::Node& node, const std::string& path, const ConfigTree& t,
                    const std::vector<std::string>& known,
                    const std::vector<std::string>& all_paths) {
  for (auto it = node.begin(); it != node.end(); ++it) {
    const std::string key = it->first.Scalar();
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    const std::string full = child_path(path, key);
    const std::string hint = unknown_key_hint(path, key, known, all_paths);
    const std::string origin = t.origin(full);
    const std::string where = origin.empty() || origin == "default" ? "config" : origin;
    if (path.empty()) {
      throw ConfigError(fmt::format("{}: unknown section '{}'{}; sections are: {}", where,
                                    clip(key), hint, join(known, ", ")));
    }
    throw ConfigError(fmt::format("{}: unknown key '{}'{}", where, clip(full), hint));
  }
}

std::string type_name(const bool&) {
  return "bool";
}
std::string type_name(const int&) {
  return "int";
}
std::string type_name(const int64_t&) {
  return "int";
}
std::string type_name(const double&) {
  return "float";
}
std::string type_name(const std::string&) {
  return "string";
}

}  // namespace detail

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
