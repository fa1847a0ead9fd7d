// Thin RAII layer over the HDF5 C API for the data layer: owned identifiers, an error policy and
// typed helpers for the few operations the shards need.
//
// Error policy: HDF5 prints its own error stack to stderr by default, once per thread. Every
// helper here first calls `quiet_errors()`, which turns that printing off for the calling thread
// (the library keeps one error stack per thread), and every failure is turned into a DataError
// whose message holds our context (file, scene, dataset) followed by HDF5's essential message: the
// outermost and the innermost description of its error stack, e.g.
//   "cannot open shard 'd/train_00000.h5': HDF5: unable to open file: truncated file: eof = 4096,
//    sblock->base_addr = 0, stored_eof = 9953088".
//
// Thread-safety: Debian's and Ubuntu's serial libhdf5 are built thread-safe; the library then
// serialises every call under its own global lock. If the linked library is not thread-safe,
// `Hdf5Lock` serialises the data layer's HDF5 sections instead (and is a no-op otherwise).
// Keep work that needs no HDF5 (decoding, augmentation) outside those sections.
#pragma once

#include "h5io/h5.h"

#include <hdf5.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace parallax::data::h5 {

// The shared RAII and error layer (h5io/h5.h).
using h5io::error_message;
using h5io::quiet_errors;

// Throws DataError "<context>: HDF5: <error_message()>" (or just the context when HDF5 has no
// message).
[[noreturn]] void fail(const std::string& context);

// Whether the linked HDF5 library serialises its calls itself (built thread-safe).
bool library_threadsafe();

// Holds the process-wide HDF5 mutex when the library is not thread-safe; a no-op otherwise.
class Hdf5Lock {
 public:
  Hdf5Lock();
  Hdf5Lock(const Hdf5Lock&) = delete;
  Hdf5Lock& operator=(const Hdf5Lock&) = delete;

 private:
  std::unique_lock<std::mutex> lock_;
};

// h5io::Id with a checked constructor for the data layer: Id(h, context) takes ownership of
// `h` and throws DataError via fail(context) if `h` < 0.
class Id : public h5io::Id {
 public:
  Id() = default;
  Id(hid_t id, const std::string& context) : h5io::Id(id) {
    if (id < 0) fail(context);
  }
};

// Checks an herr_t / htri_t result; throws via fail(context) if negative.
inline void check(herr_t status, const std::string& context) {
  if (status < 0) fail(context);
}

// --- Reading -------------------------------------------------------------------------------------

// Opens an existing file read-only; throws DataError naming the file (missing, truncated, not
// HDF5).
Id open_file_readonly(const std::string& path);
// Whether `name` exists as a link under `loc` (checks each path component).
bool link_exists(hid_t loc, const std::string& name);
// Names of the links directly under `loc` (sorted by name, as HDF5 indexes them).
std::vector<std::string> list_links(hid_t loc, const std::string& context);
// Integer attribute `name` on `loc`; nullopt if absent.
std::optional<int64_t> read_int_attribute(hid_t loc, const std::string& name,
                                          const std::string& context);

// Shape and element kind of a dataset.
struct DatasetShape {
  std::vector<int64_t> dims;
  H5T_class_t type_class = H5T_NO_CLASS;
  size_t type_size = 0;
  bool type_signed = false;
  std::string describe() const;  // e.g. "uint8 [6, 128, 224, 3]"
};
DatasetShape dataset_shape(hid_t dataset, const std::string& context);

// Reads a whole dataset into a new contiguous CPU tensor of `dtype` (HDF5 converts the stored
// type). The caller has checked the shape.
at::Tensor read_tensor(hid_t dataset, const DatasetShape& shape, at::ScalarType dtype,
                       const std::string& context);

// --- Writing -------------------------------------------------------------------------------------

// Storage choices for one dataset.
struct WriteOptions {
  int deflate_level = 0;       // 0: no compression
  std::vector<int64_t> chunk;  // empty: the whole dataset is one chunk
  bool checksum = true;        // Fletcher-32 per chunk (detects corrupt bytes on read)
};

// Creates a file (truncating), with object time tracking off (so files are bitwise reproducible)
// and the 1.8+ object formats (checksummed metadata).
Id create_file(const std::string& path);
// Creates a group with time tracking off.
Id create_group(hid_t loc, const std::string& name, const std::string& context);
// Writes a contiguous CPU tensor (uint8, int32, int64, float32, float64) as dataset `name`.
void write_tensor(hid_t loc, const std::string& name, const at::Tensor& t, const WriteOptions& opts,
                  const std::string& context);
void write_int_attribute(hid_t loc, const std::string& name, int64_t value,
                         const std::string& context);
// A UTF-8 string attribute (fixed length); read_string_attribute returns nullopt when absent.
void write_string_attribute(hid_t loc, const std::string& name, const std::string& value,
                            const std::string& context);
std::optional<std::string> read_string_attribute(hid_t loc, const std::string& name,
                                                 const std::string& context);

}  // namespace parallax::data::h5
