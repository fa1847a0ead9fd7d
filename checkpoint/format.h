// The on-disk format of a Parallax checkpoint (versions 2 to 4), its metadata and its names.
//
//   runs/<name>/checkpoints/
//     latest                   one line, "step_00000100": the last committed checkpoint
//     step_00000100/
//       metadata.json          everything below, written last (see Metadata)
//       config.yaml            the run's resolved config at save time (Metadata::config)
//       rank_00000.h5 ...      one HDF5 file per rank holding only the shards that rank owns
//     .tmp-step_00000200-<hex>/  a save in progress (or a killed one, removed by the next save)
//
// In a rank file each shard is a dataset whose HDF5 path is the tensor name ("model/fc.weight" is
// dataset "fc.weight" in group "model"). A rank that holds several disjoint pieces of one tensor
// (a tensor-parallel qkv weight: one box per fused part; a ZeRO rank's flat range of a
// tensor-parallel slice: up to 2 ndim - 1 boxes) stores the first under the tensor name and piece k
// under "<name>@<k>" (metadata.json records "piece": k; format version 4), the pieces numbered in
// the order of their first elements; no two shards of one file share a dataset. A shard is either
// a box (offsets and lengths per dimension: the dataset has the box's shape and holds it in C
// order; attributes "dtype", "offsets", "global_shape") or a flat range [begin, end) of the
// tensor's C-order flattening (a ZeRO rank's piece of a parameter: the dataset is 1-D with
// end - begin elements; attributes "dtype", "flat" = [begin, end], "global_shape"). A flat range
// covers up to 2 ndim - 1 boxes (core::flat_range_boxes); readers read it through them. A
// tensor is stored exactly: floats and integers as HDF5's native types; bfloat16, float16 and
// float8 as unsigned integers of the same width holding the raw bits; bool as uint8; the exact
// dtype is the "dtype" attribute and the metadata's "dtype".
//
// metadata.json protects itself: its second line is `  "checksum": "crc32:XXXXXXXX",`, the zlib
// crc32 of every byte after that line. The reader refuses a file whose bytes do not match (an
// edited step, a torn copy), naming the file. Version 1 files (no checksum, no config.yaml) are
// still read. Version 3 adds flat shards, version 4 several pieces of a tensor in one rank file
// (a version 3 reader would open dataset <name> for each of them). A checkpoint is written with
// the lowest version that describes it (4 with such pieces, else 3 with flat shards, else 2), so
// older builds still read the checkpoints they can, and refuse the others as "newer" rather than
// misreading them. This build reads versions 1 to 4.
//
// Thread-safety: everything here is a pure function or a value type.
#pragma once

#include "comm/topology.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace parallax::checkpoint {

inline constexpr int kFormatVersion = 4;       // the newest version this build reads and writes
inline constexpr int kBoxFormatVersion = 2;    // written when every shard is a box
inline constexpr int kFlatFormatVersion = 3;   // the first version with flat shards
inline constexpr int kPieceFormatVersion = 4;  // the first with several shards of a tensor per file
inline constexpr const char* kFormatName = "parallax-checkpoint";
inline constexpr const char* kMetadataFile = "metadata.json";
inline constexpr const char* kConfigFile = "config.yaml";
inline constexpr const char* kLatestFile = "latest";
inline constexpr const char* kTempPrefix = ".tmp-";

// Elements [begin, end) of a tensor's C-order flattening.
struct FlatRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t numel() const { return end - begin; }
  bool operator==(const FlatRange& o) const { return begin == o.begin && end == o.end; }
};

// One piece of a tensor, stored in one rank file: a box (`offsets`, `lengths`, one entry per
// dimension; a 0-d tensor's box has none) or, when `flat` is set, a flat range of the tensor
// (`offsets` and `lengths` empty; the dataset is 1-D with flat->numel() elements).
struct ShardInfo {
  std::string file;               // rank file name inside the checkpoint directory
  std::vector<int64_t> offsets;   // box: per dimension, where the piece starts in the global tensor
  std::vector<int64_t> lengths;   // box: per dimension, its extent
  uint32_t crc32 = 0;             // zlib crc32 of the dataset's bytes as stored (C order)
  std::optional<FlatRange> flat;  // flat range: the elements it holds, in order
  // Which of this file's shards of the tensor it is (0: the only or first one, dataset path =
  // the tensor name; k > 0: dataset path piece_dataset(name, k), format version 4).
  int piece = 0;
  int64_t numel() const;
  bool is_flat() const { return flat.has_value(); }
  // The shape of the shard's dataset: `lengths` for a box, {numel} for a flat range.
  std::vector<int64_t> stored_dims() const;
  // "box [0, 5] + [6, 5]" or "flat [100, 250)", for messages.
  std::string describe() const;
};

struct TensorInfo {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;     // global shape
  std::vector<ShardInfo> shards;  // disjoint, together exactly the global tensor
  int64_t numel() const;
  int64_t nbytes() const;
};

struct FileInfo {
  std::string name;   // "rank_00003.h5"
  int rank = 0;       // world rank that wrote it
  int64_t bytes = 0;  // file size on disk when committed (truncation check)
};

// A file of the checkpoint directory that is not a rank file, with its size and zlib crc32.
struct SideFile {
  std::string name;
  int64_t bytes = 0;
  uint32_t crc32 = 0;
};

// A small scalar kept in metadata.json's "extra" map (step counters, loss scale, ...).
using ExtraValue = std::variant<int64_t, double, std::string>;

struct Metadata {
  int format_version = kFormatVersion;
  int64_t step = 0;
  comm::RankLayout layout;  // dp x tp x pp at save time
  int world = 1;
  std::string config_hash;  // core::stable_hash of the resolved config text
  std::string created;      // UTC, ISO 8601
  std::vector<FileInfo> files;
  std::optional<SideFile> config;  // the resolved config the run was saved with (config.yaml)
  std::map<std::string, ExtraValue> extra;
  std::map<std::string, TensorInfo> tensors;

  // metadata.json's text (see docs/checkpoints.md for the schema), checksum line included.
  std::string to_json() const;
  // The lowest format version that describes these tensors: kFlatFormatVersion when a shard is
  // flat, else kBoxFormatVersion. The checkpointer writes that version.
  int version_needed() const;
  // Parses and validates metadata.json's text; `where` names the file in errors. Throws
  // CheckpointError for malformed JSON, a missing key, a foreign format, a newer version, a
  // checksum that does not match the text (required from version 2 on), a shard that is neither a
  // box nor a flat range inside the tensor (flat ranges from version 3 on), or shards whose sizes
  // do not add up to the tensor's.
  static Metadata from_json(const std::string& text, const std::string& where);

  bool has_extra(const std::string& key) const { return extra.count(key) != 0; }
  // Typed access; CheckpointError naming the key if it is missing or of another type (an integer
  // is accepted where a double is asked for).
  int64_t extra_int(const std::string& key) const;
  double extra_double(const std::string& key) const;
  std::string extra_string(const std::string& key) const;
  const TensorInfo* find(const std::string& name) const;
};

// Why the shards of `t` do not tile it exactly, or "" when they do: every element in exactly one
// shard. Each shard must already lie inside the tensor. Boxes and flat ranges mix (a flat range is
// checked as its boxes, core::flat_range_boxes); when every shard is flat the ranges are
// checked as 1-D intervals. O(n log n) in the number of shards plus, for boxes, the pairs whose
// dimension-0 extents overlap (a sweep along dimension 0); no limit on the number of shards. The
// text names the two overlapping shards (file and range), or the coverage and the shards.
std::string tiling_problem(const TensorInfo& t);

// "float32", "bfloat16", ... and back (CheckpointError for an unknown name).
std::string dtype_name(at::ScalarType dtype);
at::ScalarType dtype_from_name(const std::string& name, const std::string& where);

// "step_00000100" (at least 8 digits) and back (nullopt if `name` is not a step directory name).
std::string step_dir_name(int64_t step);
std::optional<int64_t> parse_step_dir_name(const std::string& name);
// "rank_00003.h5"
std::string rank_file_name(int rank);
// The name under which a per-rank entry `name` of world rank `rank` is stored: "rank/3/<name>".
std::string rank_local_name(int rank, const std::string& name);

// Tensor names are HDF5 paths: non-empty '/'-separated components, none empty, "." or "..".
// Throws CheckpointError naming the entry.
void validate_tensor_name(const std::string& name);
// The dataset path of piece `piece` of tensor `name` in a rank file.
std::string piece_dataset(const std::string& name, int piece);

// The committed checkpoint `path` denotes: a checkpoint directory (holds metadata.json), a
// checkpoints directory (holds `latest`), a run directory (holds checkpoints/latest), or the
// `latest` pointer itself (the file the checkpointer writes, or a symbolic link to a step
// directory). The one resolution every verb uses for a checkpoint path. Throws CheckpointError
// naming the path when it is none of these or `latest` points to nothing.
std::string resolve_checkpoint(const std::string& path);
// The checkpoint `latest` in `checkpoints_dir` names, or nullopt when there is no `latest`.
std::optional<std::string> latest_checkpoint(const std::string& checkpoints_dir);
// find_resume_point(resume, checkpoints_dir)'s path (checkpoint/resume.h), its warnings logged.
std::optional<std::string> resume_checkpoint(const std::string& resume,
                                             const std::string& checkpoints_dir);
// True if resolve_checkpoint(path) would succeed (for `parallax inspect`'s dispatch).
bool is_checkpoint_path(const std::string& path);

}  // namespace parallax::checkpoint
