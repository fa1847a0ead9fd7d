// The geometry of tensor pieces: which boxes of a C-ordered tensor a flat element range covers.
// Plain index arithmetic on shapes, a value type and a pure function, knowing nothing of models,
// engines or files; the engines' state pieces (parallel/engine.h) and the checkpoint format
// (checkpoint/) both describe pieces with it.
//
// Thread-safety: pure functions. Errors: parallax::Error for a range outside the tensor.
#pragma once

#include <cstdint>
#include <vector>

namespace parallax::core {

// The boxes that element range [begin, end) of a C-ordered tensor of `shape` covers, in order:
// at most 2 * ndim - 1 boxes, each contiguous in the flattened tensor (a run of partial rows, full
// blocks, partial rows). Returned as (offsets, lengths) pairs. A 0-d tensor is one box of no
// dimensions when the range is [0, 1).
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> lengths;
  int64_t numel() const;
};
std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end);

}  // namespace parallax::core
