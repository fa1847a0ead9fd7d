// The RAII and error layer over the HDF5 C API shared by the data layer (dataset shards) and the
// checkpoint layer: owned identifiers and HDF5's error stack turned into exception messages. A
// target of its own (parallax_h5io) below data/ and checkpoint/, so that core links no HDF5; it
// depends on HDF5 and the standard library only (the exception type is the caller's).
//
// Error policy: call `quiet_errors()` before HDF5 calls; it turns HDF5's automatic error printing
// off for the calling thread (the library keeps one error stack per thread). A failure then
// becomes the caller's exception with our context (file, tensor, scene) followed by HDF5's
// outermost and innermost messages, e.g. "cannot open shard 'd/train_00000.h5': HDF5: unable to
// open file: truncated file: eof = 4096, ...".
//
// Thread-safety: the functions are thread-safe to the extent the linked libhdf5 is (Debian's and
// Ubuntu's serial builds serialise every call under one global lock). An Id is not shared between
// threads.
#pragma once

#include <hdf5.h>

#include <string>

namespace parallax::h5io {

// Turns off HDF5's automatic error printing for the calling thread (idempotent, cheap).
void quiet_errors();
// The calling thread's HDF5 error stack as "<outermost>: <innermost>", then cleared; "" if empty.
std::string error_message();
// "<context>: HDF5: <error_message()>" (or the context alone when HDF5 has no message).
std::string describe(const std::string& context);

// Throws E(describe(context)).
template <class E>
[[noreturn]] void fail(const std::string& context) {
  throw E(describe(context));
}

// An owned HDF5 identifier of any kind (file, group, dataset, dataspace, type, property list,
// attribute); closed with the matching H5*close on destruction. Move-only.
class Id {
 public:
  Id() = default;
  explicit Id(hid_t id) : id_(id) {}
  ~Id() { reset(); }
  Id(Id&& o) noexcept : id_(o.id_) { o.id_ = -1; }
  Id& operator=(Id&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_;
      o.id_ = -1;
    }
    return *this;
  }
  Id(const Id&) = delete;
  Id& operator=(const Id&) = delete;

  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes the identifier (errors of the close are cleared, not reported; close files whose
  // close result matters through release() + H5Fclose).
  void reset();
  // Gives up ownership without closing.
  hid_t release() {
    const hid_t i = id_;
    id_ = -1;
    return i;
  }

 private:
  hid_t id_ = -1;
};

}  // namespace parallax::h5io
