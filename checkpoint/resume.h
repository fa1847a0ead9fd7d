// Which checkpoint a run resumes from, and whether a step directory is a whole checkpoint.
//
// train.resume=auto trusts `latest` only when the step it names verifies (checkpoint_problem);
// when `latest` is missing, unreadable or names a step that does not verify, the run resumes from
// the newest step directory that does (older than the one `latest` names, if it names one), and
// says so in a warning. It never starts over while step directories exist: when none verifies it
// is an error naming each one's problem. Only a checkpoints directory without any step directory
// (and without `latest`) means a fresh start. `latest` is authoritative when it verifies: a newer
// step directory (a save interrupted between its rename and the update of `latest`) is not used.
//
// Thread-safety: pure functions of the filesystem.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace parallax::checkpoint {

struct ResumePoint {
  std::string path;                   // the checkpoint directory
  int64_t step = 0;                   // its step (metadata.json)
  std::vector<std::string> warnings;  // why it is not what `latest` names, for the log
};

// The checkpoint a run resumes from, for the trainer's `resume` setting: "" -> none; "auto" -> as
// the file comment says (nullopt: a fresh start); anything else -> that path through
// resolve_checkpoint (a checkpoint, checkpoints or run directory, or a `latest` file). Throws
// CheckpointError naming the directory and each step's problem when no checkpoint can be trusted.
std::optional<ResumePoint> find_resume_point(const std::string& resume,
                                             const std::string& checkpoints_dir);

// Why the step directory `dir` is not a whole committed checkpoint, or "" when it is: its
// metadata.json is present, matches its checksum and names the directory's step; its config.yaml
// (if recorded) matches its size and crc32; every rank file is present with its recorded size.
// Cheap: no tensor data is read (a shard's own checksum is checked when it is loaded).
std::string checkpoint_problem(const std::string& dir);

}  // namespace parallax::checkpoint
