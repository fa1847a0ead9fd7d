// Position embeddings of another grid: what a pretrained ViT's learned position embedding becomes
// at this model's patch grid (timm's resample_abs_pos_embed).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace parallax::models {

// `pos` [1, prefix + old_h * old_w, D] (any floating dtype) resampled to [1, prefix + new_h *
// new_w, D]: the first `prefix` rows (class and register positions) are kept apart and put back
// first unchanged; the grid rows, row-major over (h, w), are resized as a [D, old_h, old_w] image
// with bicubic interpolation, antialiased, align_corners false, in float32 (timm's defaults, so
// weights resampled once at load equal timm's dynamic_img_size path, which resamples every
// forward), and returned in pos's dtype. Same grid: `pos` itself. Error when pos's length is not
// prefix + old_h * old_w.
at::Tensor resample_pos_embed(const at::Tensor& pos, int64_t prefix, int64_t old_h, int64_t old_w,
                              int64_t new_h, int64_t new_w);

}  // namespace parallax::models
