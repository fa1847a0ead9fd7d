// Internal: what the checkpoint files need on top of h5io/h5.h (owned identifiers and error
// capture): storage types per dtype, attributes, and the C-order block iterator
// that streams a tensor through a bounded buffer. Not part of the public API.
//
// Error policy: every entry point of the checkpoint layer that touches HDF5 first calls
// `quiet_errors()`, which turns HDF5's automatic error printing off for the calling thread (the
// thread-safe library keeps one error stack per thread). Failures become the caller's exception
// type with our context (file, tensor) followed by HDF5's outermost and innermost messages.
//
// Process-wide effect: HDF5's exit-time cleanup is disabled when this library loads (see h5.cpp:
// a file whose close failed on a full disk would crash it); close every file explicitly.
//
// Thread-safety: Debian's serial libhdf5 is built thread-safe and serialises calls under one global
// lock; large transfers are split into blocks (BlockIter) so that the lock is released between
// them and a background checkpoint writer never stalls the data loader for long.
#pragma once

#include "h5io/h5.h"

#include <hdf5.h>

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace parallax::checkpoint::h5 {

// The shared RAII and error layer (h5io/h5.h).
using h5io::describe;
using h5io::error_message;
using h5io::fail;
using h5io::Id;
using h5io::quiet_errors;

// The HDF5 type a tensor of `dtype` is stored as: native IEEE floats and integers where HDF5 has
// them (float32/64, int8..int64, uint8), else an unsigned integer of the same width holding the raw
// bits (bfloat16, float16, float8: 16/8-bit; bool: uint8) with the exact dtype in the "dtype"
// attribute. Throws CheckpointError for dtypes the format does not store (complex, quantized).
hid_t storage_type(at::ScalarType dtype, const std::string& tensor_name);

// Attributes (on a dataset or file).
void write_string_attr(hid_t obj, const char* name, const std::string& value);
void write_int64s_attr(hid_t obj, const char* name, const std::vector<int64_t>& values);
void write_int64_attr(hid_t obj, const char* name, int64_t value);
// Returns false if the attribute does not exist.
bool read_string_attr(hid_t obj, const char* name, std::string& out);
// An integer attribute of any integer type (false if it does not exist or is not an integer).
bool read_int64_attr(hid_t obj, const char* name, int64_t& out);

// Dataset creation properties for checkpoint datasets: contiguous, no fill value written (every
// byte is written by us), object times off (byte-identical files for identical content).
Id dataset_create_plist();

// Dimensions of a dataset's dataspace (empty for a scalar); throws E naming `context`.
std::vector<int64_t> dataset_dims(hid_t dataset, const std::string& context);

// One contiguous run, in C order, of a box of shape `dims`: a hyperslab [start, start + count)
// whose bytes are [byte_offset, byte_offset + bytes) of the box's C-order byte image.
struct Block {
  std::vector<hsize_t> start, count;
  int64_t byte_offset = 0;
  int64_t bytes = 0;
};

// Splits a box of shape `dims` with `element_size`-byte elements into C-order contiguous blocks of
// at most `budget` bytes each (at least one element). A 0-d box is one block with empty vectors.
// Calls `fn` for each block in order; their concatenation is the whole C-order image.
void for_each_block(const std::vector<int64_t>& dims, int64_t element_size, int64_t budget,
                    const std::function<void(const Block&)>& fn);

// A dataspace for a box (scalar when dims is empty).
Id make_space(const std::vector<hsize_t>& dims);
std::vector<hsize_t> to_hsize(const std::vector<int64_t>& v);

}  // namespace parallax::checkpoint::h5
