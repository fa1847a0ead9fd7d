// Precompiled header for the whole tree: LibTorch's C++ API and fmt, parsed once per build.
// Nothing project-specific goes here, so editing our headers never rebuilds the PCH.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>
