// `parallax inspect` for datasets: a report of a dataset folder or of one data shard (metadata,
// splits, scene counts, per-scene shapes, class histograms), and a verification that every scene
// reads and has the shapes dataset.json announces. The first bad scene stops it with a DataError
// naming the file and the scene.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace parallax::data {

struct InspectOptions {
  bool verify = true;            // read every scene (checks shapes, labels, HDF5 checksums)
  int64_t max_scene_lines = 10;  // per-scene shape lines printed for a shard
};

// A dataset folder (holding dataset.json): every split.
void inspect_dataset(const std::string& dir, std::FILE* out, const InspectOptions& opts = {});
// One shard file; checked against the dataset.json next to it when there is one.
void inspect_shard(const std::string& path, std::FILE* out, const InspectOptions& opts = {});

}  // namespace parallax::data
