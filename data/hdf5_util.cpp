#include "data/hdf5_util.h"

#include "core/error.h"

#include <ATen/ops/empty.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace parallax::data::h5 {
namespace {

hid_t native_type(at::ScalarType t) {
  switch (t) {
    case at::kByte:
      return H5T_NATIVE_UINT8;
    case at::kInt:
      return H5T_NATIVE_INT32;
    case at::kLong:
      return H5T_NATIVE_INT64;
    case at::kFloat:
      return H5T_NATIVE_FLOAT;
    case at::kDouble:
      return H5T_NATIVE_DOUBLE;
    default:
      throw_error<DataError>("HDF5 I/O of dtype {} is not supported", c10::toString(t));
  }
}

// Little-endian file types, so a file written anywhere reads the same everywhere.
hid_t file_type(at::ScalarType t) {
  switch (t) {
    case at::kByte:
      return H5T_STD_U8LE;
    case at::kInt:
      return H5T_STD_I32LE;
    case at::kLong:
      return H5T_STD_I64LE;
    case at::kFloat:
      return H5T_IEEE_F32LE;
    case at::kDouble:
      return H5T_IEEE_F64LE;
    default:
      throw_error<DataError>("HDF5 I/O of dtype {} is not supported", c10::toString(t));
  }
}

herr_t collect_link(hid_t, const char* name, const H5L_info_t*, void* data) {
  static_cast<std::vector<std::string>*>(data)->emplace_back(name);
  return 0;
}

std::mutex& global_hdf5_mutex() {
  static std::mutex m;  // guards a process-global library; used only when it is not thread-safe
  return m;
}

}  // namespace

bool library_threadsafe() {
  static const bool ts = [] {
    hbool_t v = false;
    return H5is_library_threadsafe(&v) >= 0 && v;
  }();
  return ts;
}

void fail(const std::string& context) {
  h5io::fail<DataError>(context);
}

Hdf5Lock::Hdf5Lock() {
  quiet_errors();
  if (!library_threadsafe()) lock_ = std::unique_lock<std::mutex>(global_hdf5_mutex());
}

Id open_file_readonly(const std::string& path) {
  quiet_errors();
  return Id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT),
            fmt::format("cannot open HDF5 file '{}'", path));
}

bool link_exists(hid_t loc, const std::string& name) {
  quiet_errors();
  // H5Lexists needs every intermediate component to exist, so walk the path.
  std::string prefix;
  size_t start = name[0] == '/' ? 1 : 0;
  if (start) prefix = "/";
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == std::string::npos) end = name.size();
    prefix += name.substr(start, end - start);
    const htri_t e = H5Lexists(loc, prefix.c_str(), H5P_DEFAULT);
    if (e <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return false;
    }
    prefix += "/";
    start = end + 1;
  }
  return true;
}

std::vector<std::string> list_links(hid_t loc, const std::string& context) {
  quiet_errors();
  std::vector<std::string> names;
  hsize_t idx = 0;
  check(H5Literate(loc, H5_INDEX_NAME, H5_ITER_INC, &idx, collect_link, &names), context);
  return names;
}

namespace {
// The attribute `name` of `loc`, opened, or nullopt when it is absent.
std::optional<Id> open_attribute(hid_t loc, const std::string& name, const std::string& context) {
  quiet_errors();
  const htri_t e = H5Aexists(loc, name.c_str());
  if (e < 0) fail(context);
  if (e == 0) return std::nullopt;
  return Id(H5Aopen(loc, name.c_str(), H5P_DEFAULT), context);
}
}  // namespace

std::optional<int64_t> read_int_attribute(hid_t loc, const std::string& name,
                                          const std::string& context) {
  std::optional<Id> opened = open_attribute(loc, name, context);
  if (!opened) return std::nullopt;
  const Id& attr = *opened;
  Id space(H5Aget_space(attr), context);
  const hssize_t n = H5Sget_simple_extent_npoints(space);
  if (n != 1)
    throw_error<DataError>("{}: attribute '{}' has {} elements, expected 1", context, name, n);
  Id type(H5Aget_type(attr), context);
  if (H5Tget_class(type) != H5T_INTEGER) {
    throw_error<DataError>("{}: attribute '{}' is not an integer", context, name);
  }
  int64_t v = 0;
  check(H5Aread(attr, H5T_NATIVE_INT64, &v), context);
  return v;
}

std::string DatasetShape::describe() const {
  std::string t;
  if (type_class == H5T_INTEGER) {
    t = fmt::format("{}int{}", type_signed ? "" : "u", type_size * 8);
  } else if (type_class == H5T_FLOAT) {
    t = fmt::format("float{}", type_size * 8);
  } else {
    t = fmt::format("type-class-{}", static_cast<int>(type_class));
  }
  return fmt::format("{} [{}]", t, fmt::join(dims, ", "));
}

DatasetShape dataset_shape(hid_t dataset, const std::string& context) {
  quiet_errors();
  DatasetShape s;
  Id space(H5Dget_space(dataset), context);
  const int rank = H5Sget_simple_extent_ndims(space);
  if (rank < 0) fail(context);
  std::vector<hsize_t> dims(static_cast<size_t>(rank));
  if (rank > 0 && H5Sget_simple_extent_dims(space, dims.data(), nullptr) < 0) fail(context);
  for (hsize_t d : dims) s.dims.push_back(static_cast<int64_t>(d));
  Id type(H5Dget_type(dataset), context);
  s.type_class = H5Tget_class(type);
  s.type_size = H5Tget_size(type);
  if (s.type_class == H5T_INTEGER) s.type_signed = H5Tget_sign(type) == H5T_SGN_2;
  return s;
}

at::Tensor read_tensor(hid_t dataset, const DatasetShape& shape, at::ScalarType dtype,
                       const std::string& context) {
  quiet_errors();
  at::Tensor t = at::empty(shape.dims, at::TensorOptions().dtype(dtype));
  if (t.numel() == 0) return t;
  check(H5Dread(dataset, native_type(dtype), H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data_ptr()), context);
  return t;
}

Id create_file(const std::string& path) {
  quiet_errors();
  const std::string ctx = fmt::format("cannot create HDF5 file '{}'", path);
  Id fcpl(H5Pcreate(H5P_FILE_CREATE), ctx);
  check(H5Pset_obj_track_times(fcpl, false), ctx);
  Id fapl(H5Pcreate(H5P_FILE_ACCESS), ctx);
  // 1.10 object formats: checksummed superblock, object headers, link indexes and chunk indexes,
  // so corrupt metadata is reported instead of misread. Readable by HDF5 >= 1.10 (and h5py).
  check(H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_V110), ctx);
  return Id(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, fcpl, fapl), ctx);
}

Id create_group(hid_t loc, const std::string& name, const std::string& context) {
  quiet_errors();
  Id gcpl(H5Pcreate(H5P_GROUP_CREATE), context);
  check(H5Pset_obj_track_times(gcpl, false), context);
  return Id(H5Gcreate2(loc, name.c_str(), H5P_DEFAULT, gcpl, H5P_DEFAULT), context);
}

void write_tensor(hid_t loc, const std::string& name, const at::Tensor& t_in,
                  const WriteOptions& opts, const std::string& context) {
  quiet_errors();
  const at::Tensor t = t_in.contiguous();
  const std::string ctx = fmt::format("{}: cannot write dataset '{}'", context, name);
  std::vector<hsize_t> dims;
  for (int64_t d : t.sizes()) dims.push_back(static_cast<hsize_t>(d));
  Id space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), ctx);
  Id dcpl(H5Pcreate(H5P_DATASET_CREATE), ctx);
  check(H5Pset_obj_track_times(dcpl, false), ctx);
  // Filters need chunked storage, and a chunk cannot be larger than a fixed-size dataset, so an
  // empty dataset (e.g. a scene without boxes) stays contiguous and unfiltered.
  if (t.numel() > 0 && (opts.deflate_level > 0 || opts.checksum)) {
    std::vector<hsize_t> chunk;
    if (opts.chunk.empty()) {
      chunk = dims;
    } else {
      for (size_t i = 0; i < dims.size(); ++i) {
        chunk.push_back(std::min<hsize_t>(dims[i], static_cast<hsize_t>(opts.chunk.at(i))));
      }
    }
    check(H5Pset_chunk(dcpl, static_cast<int>(chunk.size()), chunk.data()), ctx);
    if (opts.deflate_level > 0) {
      if (H5Zfilter_avail(H5Z_FILTER_DEFLATE) <= 0) {
        throw_error<DataError>("{}: this HDF5 library has no deflate filter; use compression 0",
                               ctx);
      }
      check(H5Pset_deflate(dcpl, static_cast<unsigned>(opts.deflate_level)), ctx);
    }
    if (opts.checksum) check(H5Pset_fletcher32(dcpl), ctx);
  }
  Id ds(H5Dcreate2(loc, name.c_str(), file_type(t.scalar_type()), space, H5P_DEFAULT, dcpl,
                   H5P_DEFAULT),
        ctx);
  if (t.numel() > 0) {
    check(H5Dwrite(ds, native_type(t.scalar_type()), H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data_ptr()),
          ctx);
  }
}

void write_int_attribute(hid_t loc, const std::string& name, int64_t value,
                         const std::string& context) {
  quiet_errors();
  const std::string ctx = fmt::format("{}: cannot write attribute '{}'", context, name);
  Id space(H5Screate(H5S_SCALAR), ctx);
  Id attr(H5Acreate2(loc, name.c_str(), H5T_STD_I64LE, space, H5P_DEFAULT, H5P_DEFAULT), ctx);
  check(H5Awrite(attr, H5T_NATIVE_INT64, &value), ctx);
}

void write_string_attribute(hid_t loc, const std::string& name, const std::string& value,
                            const std::string& context) {
  quiet_errors();
  const std::string ctx = fmt::format("{}: cannot write attribute '{}'", context, name);
  Id type(H5Tcopy(H5T_C_S1), ctx);
  check(H5Tset_size(type, std::max<size_t>(1, value.size())), ctx);
  check(H5Tset_cset(type, H5T_CSET_UTF8), ctx);
  Id space(H5Screate(H5S_SCALAR), ctx);
  Id attr(H5Acreate2(loc, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT), ctx);
  std::string padded = value;
  padded.resize(std::max<size_t>(1, value.size()), '\0');
  check(H5Awrite(attr, type, padded.data()), ctx);
}

std::optional<std::string> read_string_attribute(hid_t loc, const std::string& name,
                                                 const std::string& context) {
  std::optional<Id> opened = open_attribute(loc, name, context);
  if (!opened) return std::nullopt;
  const Id& attr = *opened;
  Id type(H5Aget_type(attr), context);
  if (H5Tget_class(type) != H5T_STRING || H5Tis_variable_str(type) > 0)
    throw_error<DataError>("{}: attribute '{}' is not a fixed-length string", context, name);
  const size_t n = H5Tget_size(type);
  if (n == 0 || n > (1u << 20))
    throw_error<DataError>("{}: attribute '{}' has a bad size ({} bytes)", context, name, n);
  std::string v(n, '\0');
  check(H5Aread(attr, type, v.data()), context);
  v.resize(std::strlen(v.c_str()));
  return v;
}

}  // namespace parallax::data::h5
