#include "checkpoint/rank_file.h"

#include "checkpoint/files.h"
#include "checkpoint/h5.h"
#include "core/error.h"

#include <fmt/format.h>

#include <filesystem>

namespace parallax::checkpoint {

RankIndex write_rank_file(const std::string& path, int rank, const std::vector<OwnedEntry>& entries,
                          int64_t block_bytes, tensor_io::Staging& staging, int64_t& data_bytes,
                          bool parallel_crc) {
  h5::quiet_errors();
  RankIndex idx;
  idx.rank = rank;
  idx.file = std::filesystem::path(path).filename().string();
  data_bytes = 0;
  {
    h5::Id fapl(H5Pcreate(H5P_FILE_ACCESS));
    if (!fapl.valid() || H5Pset_fclose_degree(fapl, H5F_CLOSE_STRONG) < 0)
      h5::fail<IoError>("file properties");
    h5::Id file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl));
    if (!file.valid())
      h5::fail<IoError>(fmt::format("rank {}: cannot create shard file '{}'", rank, path));
    h5::write_string_attr(file, "format", "parallax-checkpoint-shard");
    h5::write_int64_attr(file, "rank", rank);
    for (const OwnedEntry& e : entries) {
      const at::Tensor& src = e.tensor;
      const std::string dataset = piece_dataset(e.name, e.piece);
      const std::string ctx =
          fmt::format("rank {}: writing tensor '{}' to '{}'", rank, dataset, path);
      const uint32_t crc =
          tensor_io::write_dataset(file, dataset, src, block_bytes, staging, ctx, parallel_crc);
      if (src.dim() > 0) {
        h5::Id dset(H5Dopen2(file, dataset.c_str(), H5P_DEFAULT));
        if (!dset.valid()) h5::fail<IoError>(ctx);
        if (e.flat) {
          h5::write_int64s_attr(dset, "flat", {e.flat->begin, e.flat->end});
        } else {
          h5::write_int64s_attr(dset, "offsets", e.offsets);
        }
        h5::write_int64s_attr(dset, "global_shape", e.global_shape);
      }
      data_bytes += static_cast<int64_t>(src.nbytes());
      ShardRecord rec{e.name, src.scalar_type(), e.global_shape, {}, {}, crc, e.flat, e.piece};
      if (!e.flat) {
        rec.offsets = e.offsets;
        rec.lengths = src.sizes().vec();
      }
      idx.shards.push_back(std::move(rec));
    }
    // Close explicitly: buffered metadata is written here, and a full disk can surface here.
    if (H5Fclose(file.release()) < 0) {
      h5::fail<IoError>(
          fmt::format("rank {}: cannot write shard file '{}' (closing it failed)", rank, path));
    }
  }
  files::fsync_path(path, false);
  idx.bytes = files::file_size(path);
  return idx;
}

}  // namespace parallax::checkpoint
