#include "data/dataset.h"

#include "core/error.h"

#include <fmt/format.h>

namespace parallax::data {

std::shared_ptr<Dataset> Dataset::open(const std::string& dir, const std::string& split) {
  std::shared_ptr<Dataset> ds(new Dataset());
  ds->info_ = read_dataset_info(dir);
  ds->split_ = split;
  const SplitInfo& si = ds->info_.split(split);
  ds->where_.assign(static_cast<size_t>(si.scenes), -1);
  for (const auto& name : si.shards) {
    const std::string path = join_path(dir, name);
    auto shard = std::make_unique<ShardReader>(path);
    const int id = static_cast<int>(ds->shards_.size());
    for (int64_t idx : shard->scene_indices()) {
      if (idx >= si.scenes) {
        throw_error<DataError>("{}: index out of range: dataset.json announces {} {} scenes",
                               shard->where(idx), si.scenes, split);
      }
      int& w = ds->where_[static_cast<size_t>(idx)];
      if (w >= 0) {
        throw_error<DataError>("{}: the scene is also in '{}'", shard->where(idx),
                               ds->shards_[static_cast<size_t>(w)]->path());
      }
      w = id;
    }
    ds->shards_.push_back(std::move(shard));
  }
  for (int64_t i = 0; i < si.scenes; ++i) {
    if (ds->where_[static_cast<size_t>(i)] < 0) {
      throw_error<DataError>(
          "dataset '{}': {} scene {} is in none of the split's shards ({}); dataset.json announces "
          "{} scenes",
          dir, split, scene_name(i), fmt::join(si.shards, ", "), si.scenes);
    }
  }
  return ds;
}

const ShardReader& Dataset::shard_of(int64_t index) const {
  if (index < 0 || index >= size()) {
    throw_error<DataError>("dataset '{}': {} scene {} is out of range [0, {})", info_.dir, split_,
                           index, size());
  }
  return *shards_[static_cast<size_t>(where_[static_cast<size_t>(index)])];
}

SceneRecord Dataset::read(int64_t index) const {
  return shard_of(index).read(index, &info_);
}

SequenceInfo Dataset::sequence_info(int64_t index) const {
  return shard_of(index).sequence_info(index);
}

SceneRecord Dataset::read(int64_t index, const ShardReader::Selection& sel) const {
  return shard_of(index).read(index, info_, sel);
}

}  // namespace parallax::data
