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
// Those checks read no tensor data. The trainer also streams every shard's crc32 of the point it
// picks (verify_checkpoint_part, each rank its share of the rank files) and, when one does not
// match, asks again with that step among `known_problems`: a corrupt `latest` falls back like a
// truncated one.
//
// Thread-safety: pure functions of the filesystem.
#pragma once

#include <cstdint>
#include <map>
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
// `known_problems` (auto only): steps already found not to verify (a checksum mismatch), by step,
// with the problem; they are skipped and named like the steps checkpoint_problem rejects.
std::optional<ResumePoint> find_resume_point(
    const std::string& resume, const std::string& checkpoints_dir,
    const std::map<int64_t, std::string>& known_problems = {});

// Why the step directory `dir` is not a whole committed checkpoint, or "" when it is: its
// metadata.json is present, matches its checksum and names the directory's step; its config.yaml
// (if recorded) matches its size and crc32; every rank file is present with its recorded size.
// Cheap: no tensor data is read (a shard's own checksum is checked when it is loaded).
std::string checkpoint_problem(const std::string& dir);

// Streams the shards stored in the rank files of checkpoint `dir` whose index in metadata.json's
// `files` is `part` modulo `parts` (parts = 1: every file) and checks their crc32, after the
// checks of checkpoint_problem. `parts` ranks calling it with parts 0..parts-1 verify the whole
// checkpoint once between them. Throws CheckpointError naming the file and tensor (ChecksumError,
// checkpoint/checksum_error.h, for a crc32 mismatch). Returns the bytes verified.
int64_t verify_checkpoint_part(const std::string& dir, int part, int parts);

}  // namespace parallax::checkpoint
