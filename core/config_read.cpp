// Reading a config into typed structs (config.h: the detail:: readers that `visit` drives): each
// value parsed with the key's own type and range, errors naming the file and line of the key,
// and unknown keys rejected with a did-you-mean.
#include "core/config.h"

#include "core/strings.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>

namespace parallax::core {
namespace detail {

std::string describe_node(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "null";
  if (n.IsScalar()) return fmt::format("'{}'", clip(n.Scalar()));
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  return "?";
}

namespace {

std::string scalar_or_fail(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                           const char* expected) {
  if (!n.IsScalar())
    fail_at(t, path, fmt::format("expects {}, got {}", expected, describe_node(n)));
  return n.Scalar();
}

template <class Int>
Int parse_int(const YAML::Node& n, const std::string& path, const ConfigTree& t) {
  const std::string s = trim(scalar_or_fail(n, path, t, "an integer"));
  constexpr Int kMin = std::numeric_limits<Int>::min(), kMax = std::numeric_limits<Int>::max();
  // Names the key's own width: an int key overflows at 2^31, an int64_t one at 2^63 (issue 35).
  const auto out_of_range = [&] {
    fail_at(t, path,
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
      fail_at(t, path,
              fmt::format("'{}' is not exact as a floating-point number; write the "
                          "integer's digits",
                          clip(s)));
    }
    fail_at(t, path, fmt::format("expects an integer, got '{}'", clip(s)));
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
    fail_at(t, path, fmt::format("expects a number, got '{}'", clip(s)));
  }
  return d;
}

template <class T, class F>
void read_list(const YAML::Node& n, const std::string& path, const ConfigTree& t,
               std::vector<T>& out, const char* what, F&& one) {
  if (!n.IsSequence())
    fail_at(t, path, fmt::format("expects a list of {}, got {}", what, describe_node(n)));
  std::vector<T> v;
  for (std::size_t i = 0; i < n.size(); ++i)
    v.push_back(one(n[i], path + "[" + std::to_string(i) + "]"));
  out = std::move(v);
}

}  // namespace

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

}  // namespace parallax::core
