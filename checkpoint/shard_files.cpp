#include "checkpoint/shard_files.h"

#include "checkpoint/files.h"
#include "core/error.h"

#include <fmt/ranges.h>

#include <filesystem>

namespace parallax::checkpoint {
namespace {

constexpr size_t kMaxOpenFiles = 64;

std::string holds(const std::string& tensor) {
  return tensor.empty() ? std::string() : fmt::format(" (it holds tensor '{}')", tensor);
}

}  // namespace

ShardFiles::ShardFiles(std::string dir, const std::vector<FileInfo>& files) : dir_(std::move(dir)) {
  for (const FileInfo& f : files) info_[f.name] = f;
}

std::string ShardFiles::path_of(const std::string& file) const {
  return (std::filesystem::path(dir_) / file).string();
}

void ShardFiles::check_file(const std::string& file, const std::string& tensor) {
  if (checked_.count(file)) return;
  const auto it = info_.find(file);
  if (it == info_.end()) {
    throw_error<CheckpointError>(
        "checkpoint '{}': tensor '{}' refers to file '{}', which metadata.json does not list", dir_,
        tensor, file);
  }
  const std::string p = path_of(file);
  const int64_t size = files::file_size(p);
  if (size < 0) {
    throw_error<CheckpointError>("checkpoint '{}': shard file '{}' (rank {}) is missing{}", dir_,
                                 file, it->second.rank, holds(tensor));
  }
  if (size != it->second.bytes) {
    throw_error<CheckpointError>(
        "checkpoint '{}': shard file '{}' (rank {}) is {}: {} bytes on disk, {} recorded in "
        "metadata.json{}",
        dir_, file, it->second.rank, size < it->second.bytes ? "truncated" : "altered", size,
        it->second.bytes, holds(tensor));
  }
  checked_.insert(file);
}

hid_t ShardFiles::file(const std::string& name, const std::string& tensor) {
  auto it = open_.find(name);
  if (it != open_.end()) return it->second;
  check_file(name, tensor);
  if (open_.size() >= kMaxOpenFiles) open_.clear();
  h5::quiet_errors();
  h5::Id fapl(H5Pcreate(H5P_FILE_ACCESS));
  H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG);
  h5::Id f(H5Fopen(path_of(name).c_str(), H5F_ACC_RDONLY, fapl));
  if (!f.valid()) {
    h5::fail<CheckpointError>(
        fmt::format("checkpoint '{}': cannot open shard file '{}' (holds tensor '{}'; "
                    "truncated or not HDF5?)",
                    dir_, name, tensor));
  }
  return open_.emplace(name, std::move(f)).first->second;
}

h5::Id ShardFiles::dataset(const TensorInfo& t, const ShardInfo& s) {
  const hid_t f = file(s.file, t.name);
  h5::quiet_errors();
  const std::string path = piece_dataset(t.name, s.piece);
  h5::Id d(H5Dopen2(f, path.c_str(), H5P_DEFAULT));
  if (!d.valid()) {
    h5::fail<CheckpointError>(
        fmt::format("checkpoint '{}': shard file '{}' has no dataset '{}' for tensor '{}'", dir_,
                    s.file, path, t.name));
  }
  const std::string ctx =
      fmt::format("checkpoint '{}': shard file '{}', tensor '{}'", dir_, s.file, t.name);
  const std::vector<int64_t> dims = h5::dataset_dims(d, ctx);
  if (dims != s.stored_dims()) {
    throw_error<CheckpointError>("{}: the dataset has shape {} but metadata.json records {} ({})",
                                 ctx, dims, s.stored_dims(), s.describe());
  }
  h5::Id type(H5Dget_type(d));
  if (!type.valid() || H5Tget_size(type) != c10::elementSize(t.dtype)) {
    throw_error<CheckpointError>("{}: the dataset's element size does not match dtype {}", ctx,
                                 dtype_name(t.dtype));
  }
  return d;
}

}  // namespace parallax::checkpoint
