// A split of a dataset folder (docs/data.md): dataset.json plus the split's HDF5 shards, with
// random access to scenes by their global index.
//
// Opening reads dataset.json (schema version checked), opens every shard of the split (each
// shard's schema version checked) and checks that the shards hold exactly the scenes 0..N-1 that
// dataset.json announces, each once. Shards stay open for the lifetime of the Dataset.
// `read(i)` is thread-safe. Every failure is a DataError naming the file and, where there is one,
// the scene.
#pragma once

#include "data/schema.h"
#include "data/shard.h"

#include <memory>
#include <string>
#include <vector>

namespace parallax::data {

class Dataset {
 public:
  // Opens split `split` of the dataset folder `dir`.
  static std::shared_ptr<Dataset> open(const std::string& dir, const std::string& split);

  const DatasetInfo& info() const { return info_; }
  const std::string& split() const { return split_; }
  int64_t size() const { return static_cast<int64_t>(where_.size()); }
  // Reads scene `index` (0 <= index < size()), shape- and range-checked against dataset.json.
  SceneRecord read(int64_t index) const;
  // The same, only `sel`'s cameras and at its decode scale (ShardReader::Selection).
  SceneRecord read(int64_t index, const ShardReader::Selection& sel) const;
  // Scene `index`'s place in its sequence (all -1 for an independent scene), read from its
  // group's attributes only: cheap enough to walk a sequence back frame by frame before reading
  // any images. Checked (a prev_index that is not an earlier scene of the split is a DataError).
  SequenceInfo sequence_info(int64_t index) const;
  // The split index of the previous frame of scene `index`'s sequence; -1 at a sequence start
  // and for an independent scene.
  int64_t prev_index(int64_t index) const { return sequence_info(index).prev_index; }
  // The shard holding scene `index`.
  const ShardReader& shard_of(int64_t index) const;
  const std::vector<std::unique_ptr<ShardReader>>& shards() const { return shards_; }

 private:
  Dataset() = default;
  DatasetInfo info_;
  std::string split_;
  std::vector<std::unique_ptr<ShardReader>> shards_;
  std::vector<int> where_;  // scene index -> shard
};

}  // namespace parallax::data
