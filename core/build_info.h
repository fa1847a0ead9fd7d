// Where this build's sources and Python interpreter are: the paths tools/ scripts are run from.
// Only build_info.cpp sees the compile-time paths, so a clone in another folder recompiles that
// one file and every other object stays a compiler-cache hit (docs/building.md, "ccache").
#pragma once

#include <string>

namespace parallax::core {

// $PARALLAX_SOURCE_DIR when set, else the source folder this binary was configured from.
std::string source_dir();
// $PARALLAX_PYTHON when set, else the interpreter whose torch the build used.
std::string python_exe();

}  // namespace parallax::core
