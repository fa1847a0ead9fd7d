#include "checkpoint/export/staging.h"

#include "checkpoint/export/onnx_export.h"
#include "checkpoint/files.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"

#include <fcntl.h>
#include <unistd.h>

#include <sys/file.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

namespace fs = std::filesystem;

namespace parallax::checkpoint::exporter {

std::string staging_prefix(const std::string& name) {
  return "." + name + ".staging-";
}

LockFd::~LockFd() {
  if (fd >= 0) ::close(fd);
}

bool LockFd::lock(const fs::path& dir, double wait_s) {
  fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return false;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(wait_s * 1000));
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if ((errno != EWOULDBLOCK && errno != EINTR) || std::chrono::steady_clock::now() >= deadline)
      return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

StagingDir::~StagingDir() {
  if (path.empty()) return;
  std::error_code ec;
  fs::remove_all(path, ec);
}

void open_staging(const fs::path& dir, const std::string& name, StagingDir& staging) {
  LockFd dir_lock;
  dir_lock.lock(dir, 10);  // best effort: see remove_stale_staging()
  staging.path = dir / (staging_prefix(name) + files::random_hex(4));
  std::error_code ec;
  fs::create_directory(staging.path, ec);
  PARALLAX_CHECK(!ec, IoError, "ONNX export: cannot create '{}': {}", staging.path.string(),
                 ec.message());
  staging.lock.lock(staging.path, 0);
}

void rename_or_throw(const fs::path& from, const fs::path& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    throw_error<IoError>("ONNX export: cannot rename '{}' to '{}': {}", from.string(), to.string(),
                         std::strerror(errno));
  }
}

void prepare_output_dir(const std::string& model_file) {
  // Nothing named from the model file's path lands beside a device node, FIFO or folder, and no
  // rename replaces one (core/files.h).
  const fs::path dir = fs::path(model_file).parent_path().empty()
                           ? fs::path(".")
                           : fs::path(model_file).parent_path();
  for (const fs::path& f : {fs::path(model_file), fs::path(model_file + ".data"), dir / "parity.h5",
                            dir / "parity.json"}) {
    core::check_output_file("ONNX export: output", f.string(), core::OutputRule::kFile,
                            "the export writes a regular file there, renamed into place");
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  PARALLAX_CHECK(!ec, IoError, "ONNX export: cannot create the output folder '{}': {}",
                 dir.string(), ec.message());
  const fs::path probe = dir / (".parallax-write-test-" + files::random_hex(4));
  const int fd = ::open(probe.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
  PARALLAX_CHECK(fd >= 0, IoError, "ONNX export: cannot write to the output folder '{}': {}",
                 dir.string(), std::strerror(errno));
  ::close(fd);
  fs::remove(probe, ec);
}

int remove_stale_staging(const std::string& model_file) {
  const fs::path target(model_file);
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  const std::string prefix = staging_prefix(target.filename().string());
  // The folder's lock orders this scan after any export's create-and-lock of its staging folder
  // (a folder never appears unlocked to the scan).
  LockFd dir_lock;
  if (!dir_lock.lock(dir, 10)) return 0;
  int removed = 0;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string entry = it->path().filename().string();
    if (entry.rfind(prefix, 0) != 0 || !it->is_directory(ec)) continue;
    LockFd l;
    if (!l.lock(it->path(), 0)) continue;  // its export runs (or no flock here: keep it)
    std::error_code rm;
    fs::remove_all(it->path(), rm);
    if (rm) {
      core::log::warn("ONNX export: cannot remove the stale staging folder '{}': {}",
                      it->path().string(), rm.message());
    } else {
      core::log::info("ONNX export: removed '{}', left by an export that did not finish",
                      it->path().string());
      ++removed;
    }
  }
  return removed;
}

}  // namespace parallax::checkpoint::exporter
