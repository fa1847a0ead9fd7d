// Config system: YAML files into typed, validated structs with defaults.
//
// A config section is a plain struct with defaults in its member initialisers and a `visit`
// template that names each field once:
//
//   struct OptimConfig {
//     std::string name = "adamw";
//     double lr = 1e-3;
//     template <class V> void visit(V& v) {
//       v("name", name, "optimizer", Check::one_of({"adamw", "sgd"}));
//       v("lr", lr, "peak learning rate", Check::positive());
//     }
//   };
//
// Nested sections are fields whose type has `visit`. The same `visit` drives reading (with type
// checks, unknown-key detection and did-you-mean), writing the resolved config, and the key
// listing of `--help-config`. A root struct may also have `void validate() const` for
// cross-field rules; it throws ConfigError naming the keys.
//
// Composition: a file may list `_base_: other.yaml` (or a list of files, paths relative to the
// file). Bases are merged in order, then the file itself on top: nested maps merge key by key,
// lists and scalars replace, and a map holding `_delete_: true` replaces instead of merging (the
// MMEngine convention). Overrides are Hydra-style `a.b=value` (value parsed as YAML, so `[1,2]`,
// `true`, `3e-4` and `null` work), `a.b[1]=value` or `a.b.1=value` for one list element, and
// `~a.b` to restore a key's default. Every error names the file and line, or the override, the
// dotted key path and the offending value (long values cut to ~80 characters, core::clip).
//
// Hostile input: every YAML text (a file of the `_base_` chain, an override's value) is scanned
// event by event before a node tree is built, and rejected with the file and line when it holds
// a duplicate key (naming both lines), a recursive alias (`a: &x [*x]`, which would make every
// walk of the tree recurse forever), or more than kMaxYamlNodes nodes or kMaxYamlBytes of scalar
// text once aliases are expanded ("billion laughs"). A config file must be a regular file of at
// most kMaxConfigFileBytes holding at least one key.
#pragma once

#include "core/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace parallax::core {

// Limits on one YAML text, generous for any real config (the largest in configs/ resolves to a
// few hundred nodes and a few KiB): they stop alias bombs and stray data files, not configs.
inline constexpr std::size_t kMaxYamlNodes = 100000;           // nodes after alias expansion
inline constexpr std::size_t kMaxYamlBytes = 16u << 20;        // scalar bytes after alias expansion
inline constexpr std::size_t kMaxConfigFileBytes = 16u << 20;  // size of one config file

// Value constraints checked while reading a field.
struct Check {
  std::vector<std::string> choices;  // for strings (and each element of string lists)
  std::optional<double> min, max;    // for numbers (and each element of number lists), inclusive
  bool exclusive_min = false;
  bool one_component = false;  // for strings: one folder name (core::path_component_problem)

  static Check one_of(std::initializer_list<const char*> c) {
    Check k;
    for (const char* s : c) k.choices.emplace_back(s);
    return k;
  }
  static Check at_least(double v) {
    Check k;
    k.min = v;
    return k;
  }
  static Check positive() {
    Check k;
    k.min = 0;
    k.exclusive_min = true;
    return k;
  }
  static Check between(double lo, double hi) {
    Check k;
    k.min = lo;
    k.max = hi;
    return k;
  }
  // A string used as one folder name inside another folder (a run name): not empty, '.' or '..',
  // no '/', no leading '~', no control characters.
  static Check path_component() {
    Check k;
    k.one_component = true;
    return k;
  }
};

// Parses one YAML document after the hostile-input scan described above; `name` (a file name or
// "command-line override '...'") starts every error message. Throws ConfigError.
YAML::Node load_yaml(const std::string& text, const std::string& name);

// A YAML tree plus where each key came from ("file:line", "override 'a=b'", "default").
class ConfigTree {
 public:
  ConfigTree();

  // Loads `path`, resolving `_base_` recursively. Throws ConfigError for a missing file (with
  // did-you-mean among sibling files), a path that is a directory, a symlink loop or not a
  // regular file, an empty file, malformed or hostile YAML (file:line:column; see above) or a
  // `_base_` cycle.
  static ConfigTree from_file(const std::string& path);
  // Parses YAML text; `name` stands in for a file name in messages. Empty text (or only
  // comments) is a ConfigError.
  static ConfigTree from_string(const std::string& yaml, const std::string& name);
  // Wraps a tree built in memory (e.g. a struct's defaults); origins are `origin_label`.
  static ConfigTree from_node(const YAML::Node& node, const std::string& origin_label);

  // Merges `over` on top of this tree (see the file comment for the rules).
  void merge(const ConfigTree& over);
  // Applies one `a.b=value`, `a.b[i]=value` or `~a.b` expression. With `known_paths` (every leaf
  // key path of the schema, as KeyLister::paths() lists them), `~a.b` must name one of them or a
  // section holding some (else a ConfigError with did-you-mean); without, it is not checked.
  void apply_override(const std::string& expr, const std::vector<std::string>& known_paths = {});
  void apply_overrides(const std::vector<std::string>& exprs,
                       const std::vector<std::string>& known_paths = {});

  const YAML::Node& root() const { return root_; }
  // Where `path` (dotted, list elements as `a.b[2]`) was set; falls back to the nearest
  // ancestor; "" if unknown.
  std::string origin(const std::string& path) const;

 private:
  static ConfigTree load_recursive(const std::string& path, std::vector<std::string>& stack);
  void record_origins(const YAML::Node& node, const std::string& path, const std::string& file);

  YAML::Node root_;
  std::map<std::string, std::string> origins_;
};

namespace detail {

std::string child_path(const std::string& parent, const std::string& key);
// How a YAML value is named in messages: null, 'text' (clipped), a list, a mapping.
std::string describe_node(const YAML::Node& n);
[[noreturn]] void fail_at(const ConfigTree& tree, const std::string& path, const std::string& what);

void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t, bool& out);
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t, int& out);
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t, int64_t& out);
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t, double& out);
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                std::string& out);
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                std::vector<int>& out);
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                std::vector<int64_t>& out);
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                std::vector<double>& out);
void read_value(const YAML::Node& n, const std::string& path, const ConfigTree& t,
                std::vector<std::string>& out);

void check_value(const Check& c, const std::string& path, const ConfigTree& t, double v);
void check_value(const Check& c, const std::string& path, const ConfigTree& t,
                 const std::string& v);
template <class T>
void check_value(const Check& c, const std::string& path, const ConfigTree& t,
                 const std::vector<T>& v) {
  for (std::size_t i = 0; i < v.size(); ++i)
    check_value(c, path + "[" + std::to_string(i) + "]", t, v[i]);
}
inline void check_value(const Check&, const std::string&, const ConfigTree&, bool) {}
inline void check_value(const Check& c, const std::string& p, const ConfigTree& t, int v) {
  check_value(c, p, t, static_cast<double>(v));
}
inline void check_value(const Check& c, const std::string& p, const ConfigTree& t, int64_t v) {
  check_value(c, p, t, static_cast<double>(v));
}

// " (did you mean 'x'?)" for the unknown key `key` under `path`: the closest of `siblings` (the
// known keys of that section), else a key of the same leaf name in another section of
// `all_paths` ("train.lr" -> "optim.lr"); "" when none is plausible.
std::string unknown_key_hint(const std::string& path, const std::string& key,
                             const std::vector<std::string>& siblings,
                             const std::vector<std::string>& all_paths);

// Unknown keys under `node` (a map at `path`) that are not in `known`: throws with did-you-mean.
void reject_unknown(const YAML::Node& node, const std::string& path, const ConfigTree& t,
                    const std::vector<std::string>& known,
                    const std::vector<std::string>& all_paths);

std::string type_name(const bool&);
std::string type_name(const int&);
std::string type_name(const int64_t&);
std::string type_name(const double&);
std::string type_name(const std::string&);
template <class T>
std::string type_name(const std::vector<T>&) {
  return "list of " + type_name(T{});
}

// A default as --help-config shows it: doubles in their shortest round-trip form (0.0003, not
// YAML's 17 digits 0.00029999999999999997), everything else as YAML flow.
template <class T>
std::string listing_value(const T& value) {
  if constexpr (std::is_same_v<T, double>) {
    return fmt::format("{}", value);
  } else if constexpr (std::is_same_v<T, std::vector<double>>) {
    return fmt::format("[{}]", fmt::join(value, ", "));
  } else {
    YAML::Emitter e;
    e << YAML::Flow << YAML::Node(value);
    return e.c_str();
  }
}

template <class T, class V>
concept VisitableWith = requires(T& t, V& v) {
  t.visit(v);
};

// Any visitor: what SectionList tests an element's `visit` with.
struct AnyVisitor {
  template <class T>
  void operator()(const char*, T&, const char* = "", const Check& = {}) {}
};

// A list of sections (`optim.param_groups: [{match: ..., lr_mult: ...}, ...]`): each element is a
// section of its own, read, written and listed through its `visit`.
template <class T>
struct SectionList : std::false_type {};
template <class T>
    struct SectionList<std::vector<T>> : std::bool_constant < requires(T& t, AnyVisitor& v) {
  t.visit(v);
} > {};

}  // namespace detail

// Visitor that lists every leaf key path (for did-you-mean across sections and --help-config).
class KeyLister {
 public:
  struct Entry {
    std::string path, type, doc, default_value;
    std::vector<std::string> choices;  // the fixed set a string key must be in (Check::one_of)
  };
  template <class T>
  void operator()(const char* key, T& value, const char* doc = "", const Check& check = {}) {
    const std::string path = detail::child_path(prefix_, key);
    if constexpr (detail::VisitableWith<T, KeyLister>) {
      KeyLister sub;
      sub.prefix_ = path;
      value.visit(sub);
      entries_.insert(entries_.end(), sub.entries_.begin(), sub.entries_.end());
    } else if constexpr (detail::SectionList<T>::value) {
      // The list itself, then each element's keys as `<list>[].<key>` (their defaults: an
      // element's when the key is left out).
      entries_.push_back(
          {path,
           "list of sections",
           doc,
           value.empty() ? std::string("[]") : fmt::format("[{} sections]", value.size()),
           {}});
      KeyLister sub;
      sub.prefix_ = path + "[]";
      typename T::value_type element{};
      element.visit(sub);
      entries_.insert(entries_.end(), sub.entries_.begin(), sub.entries_.end());
    } else {
      entries_.push_back(
          {path, detail::type_name(value), doc, detail::listing_value(value), check.choices});
    }
  }
  const std::vector<Entry>& entries() const { return entries_; }
  std::vector<std::string> paths() const {
    std::vector<std::string> p;
    for (const auto& e : entries_) p.push_back(e.path);
    return p;
  }

 private:
  std::string prefix_;
  std::vector<Entry> entries_;
};

// Visitor that writes a struct into a YAML map (the resolved config).
class YamlWriter {
 public:
  template <class T>
  void operator()(const char* key, T& value, const char* = "", const Check& = {}) {
    if constexpr (detail::VisitableWith<T, YamlWriter>) {
      YamlWriter sub;
      value.visit(sub);
      node_[key] = sub.node_;
    } else if constexpr (detail::SectionList<T>::value) {
      YAML::Node list(YAML::NodeType::Sequence);
      for (auto& element : value) {
        YamlWriter sub;
        element.visit(sub);
        list.push_back(sub.node_);
      }
      node_[key] = list;
    } else {
      node_[key] = value;
    }
  }
  YAML::Node& node() { return node_; }

 private:
  YAML::Node node_{YAML::NodeType::Map};
};

// Visitor that reads a YAML map into a struct, with type and constraint checks.
class YamlReader {
 public:
  YamlReader(const YAML::Node& node, std::string path, const ConfigTree& tree,
             const std::vector<std::string>& all_paths)
      : node_(node), path_(std::move(path)), tree_(tree), all_paths_(all_paths) {}

  template <class T>
  void operator()(const char* key, T& value, const char* = "", const Check& check = {}) {
    known_.emplace_back(key);
    const YAML::Node child = node_[key];
    if (!child.IsDefined()) return;  // keep the default
    const std::string path = detail::child_path(path_, key);
    if constexpr (detail::VisitableWith<T, YamlReader>) {
      if (child.IsNull()) return;
      if (!child.IsMap()) detail::fail_at(tree_, path, "expects a section (a mapping of keys)");
      YamlReader sub(child, path, tree_, all_paths_);
      value.visit(sub);
      sub.finish();
    } else if constexpr (detail::SectionList<T>::value) {
      // Each element starts from the element type's defaults; the list replaces the default list.
      value.clear();
      if (child.IsNull()) return;
      if (!child.IsSequence())
        detail::fail_at(tree_, path, "expects a list of sections ([{key: value, ...}, ...])");
      for (std::size_t i = 0; i < child.size(); ++i) {
        const std::string element_path = path + "[" + std::to_string(i) + "]";
        if (!child[i].IsMap())
          detail::fail_at(tree_, element_path, "expects a section (a mapping of keys)");
        typename T::value_type element{};
        YamlReader sub(child[i], element_path, tree_, all_paths_);
        element.visit(sub);
        sub.finish();
        value.push_back(std::move(element));
      }
    } else {
      detail::read_value(child, path, tree_, value);
      detail::check_value(check, path, tree_, value);
    }
  }

  // Throws for keys present in the YAML map but not visited.
  void finish() const { detail::reject_unknown(node_, path_, tree_, known_, all_paths_); }

 private:
  const YAML::Node node_;
  std::string path_;
  const ConfigTree& tree_;
  const std::vector<std::string>& all_paths_;
  std::vector<std::string> known_;
};

template <class T>
YAML::Node to_yaml(T& cfg) {
  YamlWriter w;
  cfg.visit(w);
  return w.node();
}

template <class T>
std::vector<KeyLister::Entry> list_keys(T& cfg) {
  KeyLister l;
  cfg.visit(l);
  return l.entries();
}

// Reads `tree` into `cfg` (whose current values are the defaults) and runs `validate()`.
template <class T>
void bind(const ConfigTree& tree, T& cfg) {
  if (!tree.root().IsMap()) detail::fail_at(tree, "", "the config must be a mapping of sections");
  KeyLister lister;
  T defaults = cfg;
  defaults.visit(lister);
  const auto paths = lister.paths();
  YamlReader r(tree.root(), "", tree, paths);
  cfg.visit(r);
  r.finish();
  if constexpr (requires(const T& c) { c.validate(); }) cfg.validate();
}

// The resolved config as YAML text (what runs/<name>/config.yaml holds).
std::string emit_yaml(const YAML::Node& node);

// Defaults <- file (with its bases) <- overrides, bound into T and validated.
template <class T>
T load_config(const std::string& file, const std::vector<std::string>& overrides) {
  T cfg;
  ConfigTree tree = ConfigTree::from_node(to_yaml(cfg), "default");
  if (!file.empty()) tree.merge(ConfigTree::from_file(file));
  KeyLister lister;
  T defaults = cfg;
  defaults.visit(lister);
  tree.apply_overrides(overrides, lister.paths());
  bind(tree, cfg);
  return cfg;
}

// 64-bit FNV-1a of `text`, as 16 hex digits: the config hash stored with checkpoints.
std::string stable_hash(const std::string& text);

}  // namespace parallax::core
