// The run directory of a training job, <experiment.output_dir>/<experiment.name>: the run name is
// checked, the directory created, and the directory locked for the job's lifetime, so that two
// jobs can never write one run directory (checkpoints, metrics.jsonl, config.yaml) at once.
//
// The lock is an exclusive flock(2) on <run>/.lock, which holds "pid host start-time" of the job
// that holds it, for the error a second job prints. The kernel releases a flock when its holder
// exits in any way, SIGKILL and crashes included, so a .lock file left behind by a killed job
// never blocks the next one: only a live holder does. For the same reason the file is never
// removed (unlinking it would let a new job lock a fresh file while an old one still holds the
// unlinked one). The descriptor is close-on-exec: tools the trainer starts (the plot script) do
// not inherit the lock, which would outlive the job.
//
// In a multi-rank job only rank 0 locks: the other ranks may run on hosts whose view of the
// directory differs. Rank 0's outcome (success, or its error message) is broadcast to every rank
// before any other collective, so every rank returns, or throws the same error, at once: none is
// left waiting in a later collective for a rank 0 that has stopped.
//
// Symbolic links: the run directory itself may be one (to a bigger disk, say), and a WARN names
// the real path. Among what a job writes inside it (.lock, config.yaml, config_history,
// metrics.jsonl, checkpoints, plots, profile, sensitivity.json), and among the entries of
// checkpoints/ when it leads out of that folder, a symbolic link is an IoError naming it and its
// target: writes (and resumes) through it would reach elsewhere.
//
// A rerun never clobbers a run: a job that starts fresh (train.resume empty) in a directory that
// holds committed checkpoints is refused (ConfigError naming the three ways on: train.resume=auto,
// a new experiment.name, or experiment.overwrite=true). experiment.overwrite=true deletes what an
// earlier run wrote there (the entries listed in run_dir.cpp, nothing else) before the job starts.
//
// A job that created the directory and fails before its first step (a config error found late)
// leaves no directory behind: ~RunDirectory, unwinding before keep(), removes what it created when
// nothing else was put there (a launcher's logs/ folder, say, keeps it).
//
// Readers of a run directory (`parallax export`, `parallax inspect`) take no lock.
#pragma once

#include "train/run_config.h"

#include <c10/core/Device.h>

#include <filesystem>
#include <string>

namespace parallax::comm {
class Communicator;
}

namespace parallax::train {

class RunDirectory {
 public:
  // Collective over `world`: every rank calls it before any other collective on `world`. Rank 0
  // does what open_local does; the others receive its outcome (a tensor broadcast on `device`,
  // which must suit `world`'s backend). Throws, on every rank, ConfigError for a bad
  // experiment.name and IoError when the directory cannot be created or another live job holds
  // it (naming that job's pid, host and start time).
  // `fresh`: the job starts from step 0 (train.resume is empty), so committed checkpoints in the
  // directory are refused unless cfg.overwrite (see the file comment).
  static RunDirectory open(const ExperimentConfig& cfg, bool fresh, comm::Communicator& world,
                           const c10::Device& device);
  // One process: checks experiment.name, creates the directory, checks it for symbolic links (see
  // the file comment) and takes its lock without waiting. Throws as open does, and IoError for a
  // symbolic link inside the directory.
  static RunDirectory open_local(const ExperimentConfig& cfg, bool fresh = false);

  RunDirectory(RunDirectory&& other) noexcept;
  RunDirectory& operator=(RunDirectory&& other) noexcept;
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;
  ~RunDirectory();  // releases the lock (the .lock file stays)

  const std::filesystem::path& path() const { return path_; }
  // True on the process that holds the lock (rank 0).
  bool locked() const { return fd_ >= 0; }
  // The job got past its start-up: the directory stays, whatever happens later.
  void keep() { created_ = false; }

 private:
  RunDirectory(std::filesystem::path path, int fd) : path_(std::move(path)), fd_(fd) {}

  std::filesystem::path path_;
  int fd_ = -1;           // the locked .lock file, or -1
  bool created_ = false;  // this job created the directory and has not kept it yet
  int uncaught_ = 0;      // std::uncaught_exceptions() when opened
};

// Throws ConfigError naming key 'experiment.name' and its value unless the name is one folder
// name (core::path_component_problem): not empty, '.', '..', no '/', no leading '~', no control
// characters. experiment.output_dir may be any path, absolute included.
void check_run_name(const std::string& name);

// The file inside a run directory that its lock is taken on.
inline constexpr const char* kRunLockFile = ".lock";

}  // namespace parallax::train
