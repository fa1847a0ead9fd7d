// JPEG coding of camera images (libjpeg-turbo's TurboJPEG API), for shards that store each camera
// as JPEG bytes rather than raw uint8 pixels (docs/data.md, "Image codecs").
//
// Images are uint8 [H, W, 3] RGB tensors on the CPU. Encoding uses 4:2:0 chroma subsampling (what
// camera JPEGs such as nuScenes' use) and the accurate DCT. Decoding treats libjpeg-turbo's
// warnings (a truncated or corrupt stream it could half-decode) as errors, so a damaged image is a
// DataError naming it rather than grey rows in a training batch. Built without libjpeg-turbo
// (PARALLAX_WITH_TURBOJPEG unset), every call throws a DataError saying so.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace parallax::data {

// Whether this build can encode and decode JPEG.
bool jpeg_available();

// The JPEG bytes of `rgb` (uint8 [H, W, 3], contiguous or not) at `quality` (1..100). DataError
// naming `context` on a bad tensor or quality.
std::vector<uint8_t> encode_jpeg(const at::Tensor& rgb, int quality, const std::string& context);

// The size of the image a JPEG holds, without decoding it. DataError naming `context` when the
// bytes are not a JPEG.
struct JpegSize {
  int64_t height = 0, width = 0;
};
JpegSize jpeg_size(const uint8_t* data, std::size_t size, const std::string& context);

// Decodes into uint8 [ceil(H / scale), ceil(W / scale), 3] RGB, `scale` one of 1, 2, 4, 8
// (DCT-domain downscaling: the decoder computes only the coarser image). DataError naming `context`
// for bytes that do not decode cleanly (corrupt, truncated, not a JPEG) or a bad scale. With `into`
// (a contiguous uint8 CPU tensor, e.g. one camera of a scene's images) the image is decoded there
// and `into` returned; a DataError naming `context` when its shape is not the decoded image's.
at::Tensor decode_jpeg(const uint8_t* data, std::size_t size, int scale, const std::string& context,
                       at::Tensor* into = nullptr);

}  // namespace parallax::data
