#include "core/build_info.h"

#include <cstdlib>

namespace parallax::core {

std::string source_dir() {
  const char* src = std::getenv("PARALLAX_SOURCE_DIR");
  return src && *src ? src : PARALLAX_BUILD_SOURCE_DIR;
}

std::string python_exe() {
  const char* py = std::getenv("PARALLAX_PYTHON");
  return py && *py ? py : PARALLAX_BUILD_PYTHON_EXE;
}

}  // namespace parallax::core
