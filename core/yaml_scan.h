// The hostile-input scan of a YAML config (core/config.h, "Hostile input"): yaml-cpp's event
// stream checked before any node tree exists, then yaml-cpp's own load. Internal to the config
// system (core/config.cpp for files, core/config_override.cpp for override values).
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>

namespace parallax::core::detail {

// Scans `text` (a config file or a command-line override's value, `name` naming it in errors),
// then loads its first document. ConfigError, naming `name`, the line and the key, for a recursive
// alias, a document past kMaxYamlNodes or kMaxYamlBytes once aliases are expanded, a duplicate key
// or a NUL byte; a syntax error escapes as YAML::ParserException.
YAML::Node scan_and_load(const std::string& text, const std::string& name);

}  // namespace parallax::core::detail
