// A regular BEV grid in the ego frame (docs/data.md): cell (i, j) covers
// x in [x_min + i res, x_min + (i+1) res) and y in [y_min + j res, y_min + (j+1) res); tensors
// over the grid are indexed [..., i, j], flattened cells are i * ny + j. The model's query grid
// may be coarser or finer than the dataset's label grid.
#pragma once

#include <cstdint>

namespace parallax::models {

struct BevGrid {
  double x_min = -25, y_min = -25, resolution = 1.0;
  int64_t nx = 50, ny = 50;

  double x_max() const { return x_min + resolution * static_cast<double>(nx); }
  double y_max() const { return y_min + resolution * static_cast<double>(ny); }
  int64_t cells() const { return nx * ny; }
};

}  // namespace parallax::models
