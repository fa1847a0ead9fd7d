#include "core/boxes.h"

#include "core/error.h"

#include <functional>

namespace parallax::core {

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t l : lengths) n *= l;
  return n;
}

std::vector<Box> flat_range_boxes(const std::vector<int64_t>& shape, int64_t begin, int64_t end) {
  int64_t total = 1;
  for (int64_t d : shape) total *= d;
  PARALLAX_CHECK(0 <= begin && begin <= end && end <= total, Error,
                 "flat range [{}, {}) outside a tensor of {} elements", begin, end, total);
  std::vector<Box> out;
  if (begin == end) return out;
  if (shape.empty()) {
    out.push_back(Box{});
    return out;
  }
  const int64_t ndim = static_cast<int64_t>(shape.size());
  std::vector<int64_t> inner(static_cast<std::size_t>(ndim), 1);  // elements per index of dim d
  for (int64_t d = ndim - 2; d >= 0; --d) inner[d] = inner[d + 1] * shape[d + 1];
  // Range [lo, hi) inside the sub-tensor at `prefix` (indices of dims < d), lo < hi.
  std::function<void(int64_t, std::vector<int64_t>&, int64_t, int64_t)> cover =
      [&](int64_t d, std::vector<int64_t>& prefix, int64_t lo, int64_t hi) {
        if (lo >= hi) return;
        const int64_t step = inner[d];
        auto emit = [&](int64_t first,
                        int64_t count) {  // rows [first, first + count) of dim d, whole
          Box b;
          b.offsets = prefix;
          b.lengths.assign(prefix.size(), 1);
          b.offsets.push_back(first);
          b.lengths.push_back(count);
          for (int64_t k = d + 1; k < ndim; ++k) {
            b.offsets.push_back(0);
            b.lengths.push_back(shape[k]);
          }
          out.push_back(std::move(b));
        };
        int64_t a = lo / step, ra = lo % step;
        const int64_t z = hi / step, rz = hi % step;
        if (a == z) {  // inside one row of dim d
          prefix.push_back(a);
          cover(d + 1, prefix, ra, rz);
          prefix.pop_back();
          return;
        }
        if (ra != 0) {  // the partial row at the start
          prefix.push_back(a);
          cover(d + 1, prefix, ra, step);
          prefix.pop_back();
          ++a;
        }
        if (z > a) emit(a, z - a);  // whole rows
        if (rz != 0) {              // the partial row at the end
          prefix.push_back(z);
          cover(d + 1, prefix, 0, rz);
          prefix.pop_back();
        }
      };
  std::vector<int64_t> prefix;
  cover(0, prefix, begin, end);
  return out;
}

}  // namespace parallax::core
