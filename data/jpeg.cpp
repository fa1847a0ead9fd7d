#include "data/jpeg.h"

#include "core/error.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#ifdef PARALLAX_WITH_TURBOJPEG
#include <turbojpeg.h>
#endif

namespace parallax::data {

#ifdef PARALLAX_WITH_TURBOJPEG
namespace {

// One TurboJPEG instance per thread and direction (an instance is not thread-safe; creating one
// per image costs more than small images take to decode).
struct TjHandle {
  tjhandle h = nullptr;
  explicit TjHandle(bool compress) : h(compress ? tjInitCompress() : tjInitDecompress()) {}
  ~TjHandle() {
    if (h) tjDestroy(h);
  }
  TjHandle(const TjHandle&) = delete;
  TjHandle& operator=(const TjHandle&) = delete;
};

tjhandle thread_handle(bool compress, const std::string& context) {
  thread_local TjHandle enc(true), dec(false);
  tjhandle h = compress ? enc.h : dec.h;
  if (!h) throw_error<DataError>("{}: libjpeg-turbo: {}", context, tjGetErrorStr2(nullptr));
  return h;
}

}  // namespace

bool jpeg_available() {
  return true;
}

std::vector<uint8_t> encode_jpeg(const at::Tensor& rgb, int quality, const std::string& context) {
  PARALLAX_CHECK(quality >= 1 && quality <= 100, DataError, "{}: JPEG quality {} is not in 1..100",
                 context, quality);
  PARALLAX_CHECK(rgb.defined() && rgb.dim() == 3 && rgb.size(2) == 3 &&
                     rgb.scalar_type() == at::kByte && rgb.device().is_cpu() && rgb.numel() > 0,
                 DataError, "{}: JPEG encodes uint8 [H, W, 3] CPU images, got {} {}", context,
                 rgb.defined() ? c10::toString(rgb.scalar_type()) : "undefined",
                 rgb.defined() ? fmt::format("{}", fmt::join(rgb.sizes(), ", ")) : "");
  const at::Tensor c = rgb.contiguous();
  tjhandle h = thread_handle(true, context);
  unsigned char* out = nullptr;
  unsigned long out_size = 0;  // NOLINT(runtime/int): TurboJPEG's type
  const int rc = tjCompress2(h, c.data_ptr<uint8_t>(), static_cast<int>(c.size(1)), 0,
                             static_cast<int>(c.size(0)), TJPF_RGB, &out, &out_size, TJSAMP_420,
                             quality, TJFLAG_ACCURATEDCT);
  if (rc != 0) {
    const std::string why = tjGetErrorStr2(h);
    tjFree(out);
    throw_error<DataError>("{}: JPEG encoding failed: {}", context, why);
  }
  std::vector<uint8_t> bytes(out, out + out_size);
  tjFree(out);
  return bytes;
}

JpegSize jpeg_size(const uint8_t* data, std::size_t size, const std::string& context) {
  tjhandle h = thread_handle(false, context);
  int w = 0, ht = 0, subsamp = 0, colorspace = 0;
  if (size == 0 || tjDecompressHeader3(h, data, static_cast<unsigned long>(size), &w, &ht, &subsamp,
                                       &colorspace) != 0) {
    throw_error<DataError>("{}: not a JPEG image ({} bytes): {}", context, size,
                           size == 0 ? "empty" : tjGetErrorStr2(h));
  }
  return {ht, w};
}

at::Tensor decode_jpeg(const uint8_t* data, std::size_t size, int scale, const std::string& context,
                       at::Tensor* into) {
  PARALLAX_CHECK(scale == 1 || scale == 2 || scale == 4 || scale == 8, DataError,
                 "{}: JPEG scale 1/{} is not one of 1, 1/2, 1/4, 1/8", context, scale);
  const JpegSize full = jpeg_size(data, size, context);
  const tjscalingfactor f{1, scale};
  const int64_t h = TJSCALED(full.height, f), w = TJSCALED(full.width, f);
  at::Tensor out = into ? *into : at::empty({h, w, 3}, at::kByte);
  PARALLAX_CHECK(out.dim() == 3 && out.size(0) == h && out.size(1) == w && out.size(2) == 3 &&
                     out.scalar_type() == at::kByte && out.is_contiguous() && out.device().is_cpu(),
                 DataError, "{}: the JPEG image is {} x {} at scale 1/{}, expected [{}]", context,
                 h, w, scale, fmt::join(out.sizes(), ", "));
  tjhandle d = thread_handle(false, context);
  const int rc = tjDecompress2(d, data, static_cast<unsigned long>(size), out.data_ptr<uint8_t>(),
                               static_cast<int>(w), 0, static_cast<int>(h), TJPF_RGB,
                               TJFLAG_ACCURATEDCT | TJFLAG_STOPONWARNING);
  if (rc != 0) {
    throw_error<DataError>("{}: the JPEG image ({} bytes, {} x {}) does not decode: {}", context,
                           size, full.height, full.width, tjGetErrorStr2(d));
  }
  return out;
}

#else

bool jpeg_available() {
  return false;
}

namespace {
[[noreturn]] void no_jpeg(const std::string& context) {
  throw_error<DataError>(
      "{}: this build of Parallax has no JPEG codec (libjpeg-turbo was not found when it was "
      "built; install libturbojpeg0-dev and rebuild)",
      context);
}
}  // namespace

std::vector<uint8_t> encode_jpeg(const at::Tensor&, int, const std::string& context) {
  no_jpeg(context);
}
JpegSize jpeg_size(const uint8_t*, std::size_t, const std::string& context) {
  no_jpeg(context);
}
at::Tensor decode_jpeg(const uint8_t*, std::size_t, int, const std::string& context, at::Tensor*) {
  no_jpeg(context);
}

#endif

}  // namespace parallax::data
