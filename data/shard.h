// One HDF5 shard of a split: a file holding `/scenes/<index>` groups (docs/data.md) and the root
// attribute `schema_version`.
//
// ShardReader keeps the file open read-only and reads whole scenes; it is safe to call from several
// threads (HDF5 serialises the calls; shape checks and label checks run outside HDF5). Every
// failure is a DataError naming the file and, where there is one, the scene and the dataset.
//
// ShardWriter writes scenes into `<path>.tmp` and renames it to `<path>` on close(), so a shard
// that exists is complete. Raw images are stored in one chunk per camera with deflate (optional)
// and a Fletcher-32 checksum on every chunk; JPEG images as the cameras' concatenated bytes (one
// checksummed chunk, no deflate), decoded by the reader outside the HDF5 lock; the other datasets
// are one checksummed chunk each. Object times are not recorded, so the same scenes give bitwise
// identical files. Not thread-safe.
#pragma once

#include "data/hdf5_util.h"
#include "data/schema.h"

#include <map>
#include <string>
#include <vector>

namespace parallax::data {

// What a scene says of its source sample: its token ("" where it has none) and its ego pose in
// the source's global frame (float64 [4, 4]; undefined where it has none).
struct SampleMeta {
  std::string token;
  at::Tensor ego_to_global;
};

// Where a scene sits in its sequence (SceneRecord's sequence fields; docs/data.md, "Sequences"):
// all -1 for a scene stored without them (an independent scene, an older shard).
struct SequenceInfo {
  int64_t sequence = -1, frame = -1, prev_index = -1, timestamp_us = -1;
  bool in_sequence() const { return sequence >= 0; }
};

class ShardReader {
 public:
  // Opens `path`, checks its `schema_version` attribute and lists its scenes. Throws DataError
  // (missing file, not HDF5, truncated, wrong schema version, no /scenes group, bad scene names).
  explicit ShardReader(std::string path);

  const std::string& path() const { return path_; }
  // Global scene indices held by this shard, ascending.
  const std::vector<int64_t>& scene_indices() const { return indices_; }
  bool has_scene(int64_t index) const;

  // Reads scene `index`. With `info`, shapes are checked against dataset.json before any data is
  // read and labels are range-checked after; without, only the ranks and the trailing fixed
  // dimensions are checked.
  SceneRecord read(int64_t index, const DatasetInfo* info) const;
  // Reads only `cameras` (indices into the stored rig, in that order; empty: all) and decodes
  // JPEG images at 1/`decode_scale` (1, 2, 4 or 8; DCT-domain, raw images only at 1): images
  // uint8 [n, ceil(H / s), ceil(W / s), 3], intrinsics scaled to match (their first two rows by
  // 1 / s: decoded pixel j covers stored pixels [s j, s (j + 1))). Checked against `info` as
  // read() is, at the decoded size.
  struct Selection {
    std::vector<int64_t> cameras;
    int decode_scale = 1;
  };
  SceneRecord read(int64_t index, const DatasetInfo& info, const Selection& sel) const;
  // The stored shapes and types of scene `index`'s datasets, without reading their data.
  std::map<std::string, h5::DatasetShape> shapes(int64_t index) const;
  // Scene `index`'s sample token and ego pose (SampleMeta), without reading its data.
  SampleMeta sample_meta(int64_t index) const;
  // The classes of scene `index`'s visible boxes (visibility > 0), one per box, reading only its
  // `boxes` dataset (class-balanced sampling, data/cbgs.h).
  std::vector<int> visible_box_classes(int64_t index) const;
  // Scene `index`'s SequenceInfo, from its group's attributes only (no dataset is read);
  // checked as read() checks it.
  SequenceInfo sequence_info(int64_t index) const;
  // "'<path>' scene 000123": the prefix of messages about that scene.
  std::string where(int64_t index) const;

 private:
  SceneRecord read_impl(int64_t index, const DatasetInfo* info, const Selection* sel) const;

  std::string path_;
  h5::Id file_;
  std::vector<int64_t> indices_;
};

// What a split's scenes say of their source samples, by index (SampleMeta). Reads only those (no
// images). DataError naming the shard for unreadable shards or a malformed pose.
std::vector<SampleMeta> split_sample_meta(const DatasetInfo& info, const std::string& split);

// True when `path` is an HDF5 file with a /scenes group (a data shard); false for any other file,
// including non-HDF5 files. Never throws for unreadable files.
bool is_data_shard(const std::string& path);

// A DatasetInfo describing a lone shard (no dataset.json): cameras and sizes from its first scene,
// the default class lists and BEV extent with the grid size of that scene.
DatasetInfo infer_info(const ShardReader& shard);

class ShardWriter {
 public:
  // `deflate_level` 0..9 applies to images (0: uncompressed).
  // `jpeg_quality` 1..100 stores each camera as JPEG bytes at that quality (`images_jpeg`, its
  // `images_jpeg_offsets` and the group attributes `image_height`/`image_width`, docs/data.md)
  // instead of the raw `images` dataset; 0 stores raw pixels.
  ShardWriter(std::string path, int deflate_level, int jpeg_quality = 0);
  ~ShardWriter();  // if close() was not called: closes and deletes the temporary file
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  void write(const SceneRecord& scene);
  // Flushes, closes and renames the file into place. Throws IoError or DataError.
  void close();
  int64_t scenes_written() const { return written_; }

 private:
  std::string path_, tmp_path_;
  int deflate_level_;
  int jpeg_quality_;
  h5::Id file_, scenes_;
  int64_t written_ = 0;
};

}  // namespace parallax::data
