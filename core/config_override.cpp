// Hydra-style command-line overrides (config.h: ConfigTree::apply_override): `a.b=value`,
// `a.b[1]=value` / `a.b.1=value` for one list element, `+a.b=value`, and `~a.b` to restore a key's
// default, with the key path checked and the override recorded as the origin of what it sets.
#include "core/config.h"

#include "core/strings.h"
#include "core/yaml_scan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

namespace parallax::core {
namespace {

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

}  // namespace

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
                                 clip(format_path(parts, i)), detail::describe_node(cur));
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

}  // namespace parallax::core
