// The error for bytes that do not match their recorded checksum: a checkpoint shard (its crc32 in
// metadata.json) or a tensor of an exported weights.h5 (its "crc32" attribute). It says the file is
// corrupt, not that the model or the config changed: the trainer does not blame changed config keys
// for it, and train.resume=auto falls back to an older checkpoint (checkpoint/resume.h).
#pragma once

#include "core/error.h"

namespace parallax::checkpoint {

class ChecksumError : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

}  // namespace parallax::checkpoint
