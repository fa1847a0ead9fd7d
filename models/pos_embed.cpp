#include "models/pos_embed.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

namespace parallax::models {

at::Tensor resample_pos_embed(const at::Tensor& pos, int64_t prefix, int64_t old_h, int64_t old_w,
                              int64_t new_h, int64_t new_w) {
  PARALLAX_CHECK(
      pos.dim() == 3 && pos.size(0) == 1 && prefix >= 0 && pos.size(1) == prefix + old_h * old_w,
      Error, "position embedding {}: expected [1, {} + {} x {}, D]", fmt::format("{}", pos.sizes()),
      prefix, old_h, old_w);
  if (old_h == new_h && old_w == new_w) return pos;
  const int64_t d = pos.size(2);
  const at::Tensor grid = pos.narrow(1, prefix, old_h * old_w)
                              .to(at::kFloat)
                              .reshape({1, old_h, old_w, d})
                              .permute({0, 3, 1, 2});
  const at::Tensor resized =
      at::_upsample_bicubic2d_aa(grid, {new_h, new_w}, /*align_corners=*/false)
          .permute({0, 2, 3, 1})
          .reshape({1, new_h * new_w, d})
          .to(pos.scalar_type());
  if (prefix == 0) return resized;
  return at::cat({pos.narrow(1, 0, prefix), resized}, 1);
}

}  // namespace parallax::models
