// Names of an enum's values, for the policies the config holds as strings and the code as enums
// (parsed once, at the edge: parallel.pp_schedule, train.activation_checkpointing,
// precision.mode). A table of {value, name} pairs gives both directions.
#pragma once

#include "core/error.h"
#include "core/strings.h"

#include <string>
#include <vector>

namespace parallax::core {

template <class E>
struct EnumName {
  E value;
  const char* name;
};

// The name of `value` in `table` ("?" for a value the table lacks).
template <class E, std::size_t N>
const char* enum_name(const EnumName<E> (&table)[N], E value) {
  for (const auto& e : table) {
    if (e.value == value) return e.name;
  }
  return "?";
}

// The value named `name`; ConfigError "key '<key>': unknown <what> '<name>' (a, b, c)" otherwise.
template <class E, std::size_t N>
E parse_enum(const EnumName<E> (&table)[N], const std::string& name, const char* key,
             const char* what) {
  std::vector<std::string> names;
  for (const auto& e : table) {
    if (name == e.name) return e.value;
    names.emplace_back(e.name);
  }
  throw_error<ConfigError>("key '{}': unknown {} '{}' ({})", key, what, name, join(names, ", "));
}

}  // namespace parallax::core
