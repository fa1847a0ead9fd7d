// Name globs: the module-path and parameter-name patterns of lora.targets, lora.trainable and
// qat.skip. A header of its own (not core/strings.h) so that the two trainers share it without one
// including the other, and without every includer of the string helpers seeing fnmatch.h.
#pragma once

#include <fnmatch.h>

#include <string>

namespace parallax::core {

// fnmatch(3) without flags: '*' also crosses dots, as in PEFT's and ModelOpt's name patterns.
inline bool glob_match(const std::string& pattern, const std::string& name) {
  return ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

}  // namespace parallax::core
