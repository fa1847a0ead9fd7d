#include "checkpoint/h5.h"

#include "core/error.h"

#include <algorithm>

namespace parallax::checkpoint::h5 {
namespace {

// At exit HDF5 closes every file still open. A file whose close failed (a write error while
// flushing, e.g. a full disk during a checkpoint) cannot be closed again: HDF5 1.10 crashes in
// that second close. A failed save must leave a working process, so the exit-time cleanup is
// turned off before the library's first use (shared-library initialisation runs before main);
// every file is closed explicitly by its owner (RAII), exactly once.
[[maybe_unused]] const bool kNoExitCleanup = [] {
  H5dont_atexit();
  return true;
}();

}  // namespace

hid_t storage_type(at::ScalarType dtype, const std::string& tensor_name) {
  switch (dtype) {
    case at::kFloat:
      return H5T_NATIVE_FLOAT;
    case at::kDouble:
      return H5T_NATIVE_DOUBLE;
    case at::kChar:
      return H5T_NATIVE_INT8;
    case at::kByte:
      return H5T_NATIVE_UINT8;
    case at::kShort:
      return H5T_NATIVE_INT16;
    case at::kInt:
      return H5T_NATIVE_INT32;
    case at::kLong:
      return H5T_NATIVE_INT64;
    case at::kBFloat16:
    case at::kHalf:
      return H5T_NATIVE_UINT16;
    case at::kBool:
    case at::kFloat8_e4m3fn:
    case at::kFloat8_e5m2:
      return H5T_NATIVE_UINT8;
    default:
      throw_error<CheckpointError>("tensor '{}': dtype {} cannot be stored in a checkpoint",
                                   tensor_name, c10::toString(dtype));
  }
}

void write_string_attr(hid_t obj, const char* name, const std::string& value) {
  Id type(H5Tcopy(H5T_C_S1));
  if (!type.valid() || H5Tset_size(type, std::max<size_t>(1, value.size())) < 0 ||
      H5Tset_strpad(type, H5T_STR_NULLTERM) < 0) {
    fail<IoError>(fmt::format("cannot create the string type of attribute '{}'", name));
  }
  Id space(H5Screate(H5S_SCALAR));
  Id attr(H5Acreate2(obj, name, type, space, H5P_DEFAULT, H5P_DEFAULT));
  std::string buf = value;
  buf.resize(std::max<size_t>(1, value.size()), '\0');
  if (!attr.valid() || H5Awrite(attr, type, buf.data()) < 0) {
    fail<IoError>(fmt::format("cannot write attribute '{}'", name));
  }
}

void write_int64s_attr(hid_t obj, const char* name, const std::vector<int64_t>& values) {
  Id space =
      values.empty() ? Id(H5Screate(H5S_NULL)) : make_space({static_cast<hsize_t>(values.size())});
  Id attr(H5Acreate2(obj, name, H5T_NATIVE_INT64, space, H5P_DEFAULT, H5P_DEFAULT));
  if (!attr.valid() || (!values.empty() && H5Awrite(attr, H5T_NATIVE_INT64, values.data()) < 0)) {
    fail<IoError>(fmt::format("cannot write attribute '{}'", name));
  }
}

void write_int64_attr(hid_t obj, const char* name, int64_t value) {
  Id space(H5Screate(H5S_SCALAR));
  Id attr(H5Acreate2(obj, name, H5T_NATIVE_INT64, space, H5P_DEFAULT, H5P_DEFAULT));
  if (!attr.valid() || H5Awrite(attr, H5T_NATIVE_INT64, &value) < 0) {
    fail<IoError>(fmt::format("cannot write attribute '{}'", name));
  }
}

bool read_string_attr(hid_t obj, const char* name, std::string& out) {
  if (H5Aexists(obj, name) <= 0) return false;
  Id attr(H5Aopen(obj, name, H5P_DEFAULT));
  if (!attr.valid()) return false;
  Id ftype(H5Aget_type(attr));
  if (!ftype.valid() || H5Tget_class(ftype) != H5T_STRING) return false;
  if (H5Tis_variable_str(ftype) > 0) {
    Id mtype(H5Tcopy(H5T_C_S1));
    H5Tset_size(mtype, H5T_VARIABLE);
    char* p = nullptr;
    if (H5Aread(attr, mtype, &p) < 0) return false;
    out = p ? p : "";
    Id space(H5Aget_space(attr));
    H5Dvlen_reclaim(mtype, space, H5P_DEFAULT, &p);
    return true;
  }
  const size_t size = H5Tget_size(ftype);
  Id mtype(H5Tcopy(H5T_C_S1));
  H5Tset_size(mtype, size + 1);
  H5Tset_strpad(mtype, H5T_STR_NULLTERM);
  std::string buf(size + 1, '\0');
  if (H5Aread(attr, mtype, buf.data()) < 0) return false;
  out.assign(buf.c_str());
  return true;
}

bool read_int64_attr(hid_t obj, const char* name, int64_t& out) {
  if (H5Aexists(obj, name) <= 0) return false;
  Id attr(H5Aopen(obj, name, H5P_DEFAULT));
  if (!attr.valid()) return false;
  Id ftype(H5Aget_type(attr));
  Id space(H5Aget_space(attr));
  if (!ftype.valid() || H5Tget_class(ftype) != H5T_INTEGER || !space.valid() ||
      H5Sget_simple_extent_npoints(space) != 1) {
    return false;
  }
  return H5Aread(attr, H5T_NATIVE_INT64, &out) >= 0;
}

Id dataset_create_plist() {
  Id dcpl(H5Pcreate(H5P_DATASET_CREATE));
  if (!dcpl.valid() || H5Pset_layout(dcpl, H5D_CONTIGUOUS) < 0 ||
      H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER) < 0 || H5Pset_obj_track_times(dcpl, 0) < 0) {
    fail<IoError>("cannot create dataset properties");
  }
  return dcpl;
}

std::vector<int64_t> dataset_dims(hid_t dataset, const std::string& context) {
  Id space(H5Dget_space(dataset));
  if (!space.valid()) fail<CheckpointError>(context);
  const int nd = H5Sget_simple_extent_ndims(space);
  if (nd < 0) fail<CheckpointError>(context);
  std::vector<hsize_t> d(static_cast<size_t>(nd));
  if (nd > 0 && H5Sget_simple_extent_dims(space, d.data(), nullptr) < 0)
    fail<CheckpointError>(context);
  return std::vector<int64_t>(d.begin(), d.end());
}

Id make_space(const std::vector<hsize_t>& dims) {
  Id s(dims.empty() ? H5Screate(H5S_SCALAR)
                    : H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
  if (!s.valid()) fail<IoError>("cannot create a dataspace");
  return s;
}

std::vector<hsize_t> to_hsize(const std::vector<int64_t>& v) {
  return std::vector<hsize_t>(v.begin(), v.end());
}

void for_each_block(const std::vector<int64_t>& dims, int64_t element_size, int64_t budget,
                    const std::function<void(const Block&)>& fn) {
  budget = std::max(budget, element_size);
  const size_t nd = dims.size();
  if (nd == 0) {
    fn(Block{{}, {}, 0, element_size});
    return;
  }
  for (int64_t d : dims) {
    if (d == 0) return;
  }
  // inner[k]: bytes of one index step along dim k (the product of the dims after k).
  std::vector<int64_t> inner(nd);
  int64_t acc = element_size;
  for (size_t k = nd; k-- > 0;) {
    inner[k] = acc;
    acc *= dims[k];
  }
  size_t k = 0;
  while (k + 1 < nd && inner[k] > budget) ++k;
  const int64_t rows = std::max<int64_t>(1, budget / inner[k]);
  int64_t outer_count = 1;
  for (size_t i = 0; i < k; ++i) outer_count *= dims[i];

  Block b;
  b.start.assign(nd, 0);
  b.count.assign(nd, 1);
  for (size_t i = k + 1; i < nd; ++i) b.count[i] = static_cast<hsize_t>(dims[i]);
  std::vector<int64_t> outer(k, 0);
  for (int64_t o = 0; o < outer_count; ++o) {
    int64_t base = 0;
    for (size_t i = 0; i < k; ++i) {
      b.start[i] = static_cast<hsize_t>(outer[i]);
      base += outer[i] * inner[i];
    }
    for (int64_t a = 0; a < dims[k]; a += rows) {
      const int64_t n = std::min(rows, dims[k] - a);
      b.start[k] = static_cast<hsize_t>(a);
      b.count[k] = static_cast<hsize_t>(n);
      b.byte_offset = base + a * inner[k];
      b.bytes = n * inner[k];
      fn(b);
    }
    for (size_t i = k; i-- > 0;) {  // next outer multi-index, C order
      if (++outer[i] < dims[i]) break;
      outer[i] = 0;
    }
  }
}

}  // namespace parallax::checkpoint::h5
