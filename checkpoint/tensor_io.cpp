#include "checkpoint/tensor_io.h"

#include "checkpoint/format.h"
#include "core/error.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <zlib.h>

namespace parallax::checkpoint::tensor_io {
namespace {

at::Tensor block_view(const at::Tensor& t, const h5::Block& b) {
  at::Tensor v = t;
  for (size_t d = 0; d < b.start.size(); ++d) {
    v = v.narrow(static_cast<int64_t>(d), static_cast<int64_t>(b.start[d]),
                 static_cast<int64_t>(b.count[d]));
  }
  return v;
}

}  // namespace

uint32_t crc32_update(uint32_t crc, const void* p, int64_t n, bool parallel) {
  const auto* bytes = static_cast<const uint8_t*>(p);
  constexpr int64_t kChunk = 4 << 20;
  if (!parallel || n < 2 * kChunk || at::get_num_threads() < 2) {
    return static_cast<uint32_t>(crc32_z(crc, bytes, static_cast<z_size_t>(n)));
  }
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<uLong> part(static_cast<size_t>(chunks));
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t len = std::min(kChunk, n - c * kChunk);
      part[static_cast<size_t>(c)] = crc32_z(0L, bytes + c * kChunk, static_cast<z_size_t>(len));
    }
  });
  uLong out = crc;
  for (int64_t c = 0; c < chunks; ++c) {
    out = crc32_combine(out, part[static_cast<size_t>(c)],
                        static_cast<z_off_t>(std::min(kChunk, n - c * kChunk)));
  }
  return static_cast<uint32_t>(out);
}

at::Tensor Staging::get(int64_t bytes, bool pinned) {
  if (!buf_.defined() || buf_.numel() < bytes || (pinned && !buf_.is_pinned())) {
    buf_ = at::Tensor();
    buf_ = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned));
  }
  return buf_.narrow(0, 0, bytes);
}

uint32_t write_dataset(hid_t loc, const std::string& name, const at::Tensor& src,
                       int64_t block_bytes, Staging& staging, const std::string& context,
                       bool parallel_crc) {
  const at::ScalarType dtype = src.scalar_type();
  const hid_t type = h5::storage_type(dtype, name);
  const std::vector<int64_t> lengths = src.sizes().vec();
  const int64_t esize = static_cast<int64_t>(src.element_size());
  h5::Id lcpl(H5Pcreate(H5P_LINK_CREATE));
  if (!lcpl.valid() || H5Pset_create_intermediate_group(lcpl, 1) < 0) h5::fail<IoError>(context);
  const h5::Id dcpl = h5::dataset_create_plist();
  h5::Id space = h5::make_space(h5::to_hsize(lengths));
  h5::Id dset(H5Dcreate2(loc, name.c_str(), type, space, lcpl, dcpl, H5P_DEFAULT));
  if (!dset.valid()) h5::fail<IoError>(context);
  h5::write_string_attr(dset, "dtype", dtype_name(dtype));
  const bool direct = src.is_cpu() && src.is_contiguous();
  const auto* base = direct ? static_cast<const uint8_t*>(src.const_data_ptr()) : nullptr;
  uint32_t crc = 0;
  h5::for_each_block(lengths, esize, block_bytes, [&](const h5::Block& b) {
    const uint8_t* ptr = nullptr;
    if (direct) {
      ptr = base + b.byte_offset;
    } else {
      at::Tensor buf = staging.get(b.bytes, src.is_cuda());
      const std::vector<int64_t> shape(b.count.begin(), b.count.end());
      buf.view(dtype).view(shape).copy_(block_view(src, b));
      ptr = static_cast<const uint8_t*>(buf.const_data_ptr());
    }
    crc = crc32_update(crc, ptr, b.bytes, parallel_crc);
    if (lengths.empty()) {
      if (H5Dwrite(dset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, ptr) < 0) h5::fail<IoError>(context);
      return;
    }
    h5::Id fspace(H5Dget_space(dset));
    h5::Id mspace = h5::make_space(b.count);
    if (!fspace.valid() ||
        H5Sselect_hyperslab(fspace, H5S_SELECT_SET, b.start.data(), nullptr, b.count.data(),
                            nullptr) < 0 ||
        H5Dwrite(dset, type, mspace, fspace, H5P_DEFAULT, ptr) < 0) {
      h5::fail<IoError>(context);
    }
  });
  return crc;
}

at::ScalarType dataset_dtype(hid_t dset, const std::string& context) {
  std::string name;
  if (h5::read_string_attr(dset, "dtype", name)) return dtype_from_name(name, context);
  h5::Id type(H5Dget_type(dset));
  const size_t size = H5Tget_size(type);
  switch (H5Tget_class(type)) {
    case H5T_FLOAT:
      if (size == 4) return at::kFloat;
      if (size == 8) return at::kDouble;
      if (size == 2) return at::kHalf;
      break;
    case H5T_INTEGER: {
      const bool sign = H5Tget_sign(type) == H5T_SGN_2;
      if (size == 1) return sign ? at::kChar : at::kByte;
      if (size == 2 && sign) return at::kShort;
      if (size == 4 && sign) return at::kInt;
      if (size == 8 && sign) return at::kLong;
      break;
    }
    case H5T_ENUM:
      if (size == 1) return at::kBool;  // h5py's bool
      break;
    default:
      break;
  }
  throw_error<CheckpointError>("{}: unsupported HDF5 element type (class {}, {} bytes)", context,
                               static_cast<int>(H5Tget_class(type)), size);
}

namespace {

// `lengths` elements from `offsets` of the open dataset (offsets empty: all of it), read as the
// dataset's own element type (its "dtype" attribute when it has one: bf16 is stored as 16-bit
// integers).
at::Tensor read_open_dataset(hid_t dset, at::ScalarType dtype, const std::string& name,
                             const std::vector<int64_t>& offsets,
                             const std::vector<int64_t>& lengths, const std::string& context) {
  at::Tensor out = at::empty(lengths, at::TensorOptions().dtype(dtype));
  if (out.numel() == 0) return out;
  std::string attr;
  h5::Id native;
  hid_t mtype;
  if (h5::read_string_attr(dset, "dtype", attr)) {
    mtype = h5::storage_type(dtype, name);
  } else {
    h5::Id ftype(H5Dget_type(dset));
    native = h5::Id(H5Tget_native_type(ftype, H5T_DIR_ASCEND));
    mtype = native;
  }
  herr_t rc;
  if (offsets.empty()) {
    rc = H5Dread(dset, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data_ptr());
  } else {
    h5::Id fspace(H5Dget_space(dset));
    h5::Id mspace = h5::make_space(h5::to_hsize(lengths));
    const std::vector<hsize_t> start = h5::to_hsize(offsets), count = h5::to_hsize(lengths);
    rc = H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
    if (rc >= 0) rc = H5Dread(dset, mtype, mspace, fspace, H5P_DEFAULT, out.data_ptr());
  }
  if (rc < 0) h5::fail<CheckpointError>(context);
  return out;
}

}  // namespace

at::Tensor read_dataset(hid_t loc, const std::string& name, const std::string& context) {
  h5::Id dset(H5Dopen2(loc, name.c_str(), H5P_DEFAULT));
  if (!dset.valid()) h5::fail<CheckpointError>(context);
  const at::ScalarType dtype = dataset_dtype(dset, context);
  return read_open_dataset(dset, dtype, name, {}, h5::dataset_dims(dset, context), context);
}

at::Tensor read_dataset_box(hid_t loc, const std::string& name, const std::vector<int64_t>& offsets,
                            const std::vector<int64_t>& lengths, const std::string& context) {
  h5::Id dset(H5Dopen2(loc, name.c_str(), H5P_DEFAULT));
  if (!dset.valid()) h5::fail<CheckpointError>(context);
  const at::ScalarType dtype = dataset_dtype(dset, context);
  const std::vector<int64_t> dims = h5::dataset_dims(dset, context);
  bool inside = offsets.size() == dims.size() && lengths.size() == dims.size();
  for (std::size_t d = 0; inside && d < dims.size(); ++d)
    inside = offsets[d] >= 0 && lengths[d] >= 0 && offsets[d] + lengths[d] <= dims[d];
  PARALLAX_CHECK(inside, CheckpointError, "{}: the box at [{}] of size [{}] lies outside [{}]",
                 context, fmt::join(offsets, ", "), fmt::join(lengths, ", "),
                 fmt::join(dims, ", "));
  return read_open_dataset(dset, dtype, name, dims.empty() ? std::vector<int64_t>{} : offsets,
                           lengths, context);
}

uint32_t dataset_crc32(hid_t loc, const std::string& name, int64_t block_bytes,
                       const std::string& context) {
  h5::Id dset(H5Dopen2(loc, name.c_str(), H5P_DEFAULT));
  if (!dset.valid()) h5::fail<CheckpointError>(context);
  const at::ScalarType dtype = dataset_dtype(dset, context);
  const std::vector<int64_t> dims = h5::dataset_dims(dset, context);
  uint32_t crc = 0;
  h5::for_each_block(dims, static_cast<int64_t>(c10::elementSize(dtype)), block_bytes,
                     [&](const h5::Block& b) {
                       const at::Tensor part = read_open_dataset(
                           dset, dtype, name, std::vector<int64_t>(b.start.begin(), b.start.end()),
                           std::vector<int64_t>(b.count.begin(), b.count.end()), context);
                       crc = crc32_update(crc, part.const_data_ptr(), b.bytes, /*parallel=*/true);
                     });
  return crc;
}

}  // namespace parallax::checkpoint::tensor_io
