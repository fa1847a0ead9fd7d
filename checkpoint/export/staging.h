// Internal: where an ONNX export writes before it publishes. Everything goes into a staging folder
// ".<name>.staging-<hex>" beside the model file, locked (flock on the folder) while the export
// runs, so that another export's remove_stale_staging() (onnx_export.h) leaves it alone; the
// export then renames its files into place, the model last. The output folder's own checks
// (prepare_output_dir) and the removal of stale staging folders are defined in staging.cpp too.
//
// Errors: IoError naming the path. Thread-safety: none needed (one export per process and file).
#pragma once

#include <filesystem>
#include <string>

namespace parallax::checkpoint::exporter {

// The prefix of the staging folders of exports to `name` (".model.onnx.staging-").
std::string staging_prefix(const std::string& name);

// An open descriptor, closed on scope exit (closing releases its flock).
struct LockFd {
  int fd = -1;
  LockFd() = default;
  LockFd(const LockFd&) = delete;
  LockFd& operator=(const LockFd&) = delete;
  ~LockFd();
  // Opens directory `dir` and takes an exclusive flock on it: blocking up to `wait_s`, or not at
  // all (0). False when it cannot (held elsewhere, or a file system without flock on
  // directories).
  bool lock(const std::filesystem::path& dir, double wait_s);
};

// The staging folder of this export: locked while the export runs; removed on scope exit unless
// released (path cleared), then unlocked.
struct StagingDir {
  std::filesystem::path path;
  LockFd lock;
  ~StagingDir();
};

// Creates and locks the staging folder of an export to `dir`/`name` in `staging` (whose path is
// empty): under the folder's lock, so that no scan sees it unlocked.
void open_staging(const std::filesystem::path& dir, const std::string& name, StagingDir& staging);

// rename(2), or IoError naming both paths.
void rename_or_throw(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace parallax::checkpoint::exporter
