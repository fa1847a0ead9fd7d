// Internal: the rank files of one checkpoint as its reader sees them. Each file is checked once
// against metadata.json (listed, present, of the recorded size), opened read-only on demand with
// at most kMaxOpenFiles open at once (a checkpoint of thousands of ranks must not exhaust file
// descriptors), and a shard's dataset is opened with its shape and element size checked against
// its record, so a reader never reads bytes that metadata.json does not describe.
//
// Errors: CheckpointError naming the checkpoint, the file, its rank and the tensor it holds.
// Thread-safety: none (the reader's).
#pragma once

#include "checkpoint/format.h"
#include "checkpoint/h5.h"

#include <map>
#include <set>
#include <string>
#include <vector>

namespace parallax::checkpoint {

class ShardFiles {
 public:
  // `dir`: the checkpoint directory; `files`: metadata.json's "files".
  ShardFiles(std::string dir, const std::vector<FileInfo>& files);

  // `file` inside the checkpoint directory.
  std::string path_of(const std::string& file) const;
  // Checks that `file` is listed, present and of the recorded size (once per file); `tensor` (or
  // "") names what it holds, in messages.
  void check_file(const std::string& file, const std::string& tensor);
  // The open file `name` (checked first); valid until the next call of file() or dataset().
  hid_t file(const std::string& name, const std::string& tensor);
  // Shard `s` of `t`: its dataset, of the recorded shape and element size.
  h5::Id dataset(const TensorInfo& t, const ShardInfo& s);

 private:
  std::string dir_;
  std::map<std::string, FileInfo> info_;
  std::map<std::string, h5::Id> open_;
  std::set<std::string> checked_;  // present with the recorded size
};

}  // namespace parallax::checkpoint
