#include "train/run_dir.h"

#include "checkpoint/config_record.h"
#include "comm/agree.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <exception>
#include <optional>
#include <sstream>
#include <utility>

namespace fs = std::filesystem;

namespace parallax::train {
namespace {

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// "pid 123 on host node7 (started 2025-01-01T10:00:00Z)" from the lock file's "123 node7 <time>".
std::string describe_holder(int fd) {
  char buf[512] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  std::istringstream in(std::string(buf, n > 0 ? static_cast<std::size_t>(n) : 0));
  long long pid = 0;
  std::string host, started;
  if (in >> pid >> host >> started) {
    return fmt::format("pid {} on host {} (started {})", pid, core::clip(host, 100),
                       core::clip(started, 40));
  }
  // The holder has the lock but has not written its record yet (or an old version wrote another).
  return "a job that has not recorded its pid yet";
}

std::string errno_text(int err) {
  return std::strerror(err);
}

// What a training job writes directly inside its run directory (trainer, checkpointer,
// config_record, metrics, profiler, plot tool, QAT report).
const char* const kWrittenEntries[] = {
    kRunLockFile,    "config.yaml",     checkpoint::kConfigHistoryDir,
    "metrics.jsonl", "checkpoints",     "plots",
    "profile",       "sensitivity.json"};

// The entries an earlier run leaves that experiment.overwrite=true deletes (not .lock: it is held).
const char* const kRunOutputs[] = {"config.yaml",     checkpoint::kConfigHistoryDir,
                                   "metrics.jsonl",   "checkpoints",
                                   "plots",           "profile",
                                   "sensitivity.json"};

// The newest committed checkpoint's folder name in <run>/checkpoints ("" when none): a `latest`
// pointer, or a step_XXXXXXXX folder with its metadata.json.
std::string committed_checkpoint(const fs::path& run) {
  std::error_code ec;
  const fs::path ckpts = run / "checkpoints";
  if (!fs::is_directory(ckpts, ec)) return "";
  std::string newest;
  for (fs::directory_iterator it(ckpts, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code e;
    if (core::starts_with(name, "step_") && fs::exists(it->path() / "metadata.json", e))
      newest = std::max(newest, name);
  }
  if (newest.empty() && fs::exists(ckpts / "latest", ec)) newest = "latest";
  return newest;
}

void refuse_or_overwrite(const fs::path& run, const ExperimentConfig& cfg) {
  const std::string found = committed_checkpoint(run);
  if (found.empty()) return;
  if (!cfg.overwrite) {
    throw_error<ConfigError>(
        "run directory '{}' holds checkpoints of an earlier run (newest: {}) and train.resume is "
        "empty, so this job would start again from step 0 over them; choose one: "
        "train.resume=auto (continue that run), experiment.name=<another name> (a new run beside "
        "it), or experiment.overwrite=true (delete that run's checkpoints, metrics and plots, and "
        "start again here)",
        core::clip(run.string(), 300), found);
  }
  for (const char* entry : kRunOutputs) {
    std::error_code ec;
    fs::remove_all(run / entry, ec);
    if (ec)
      throw_error<IoError>("experiment.overwrite=true: cannot delete '{}': {}",
                           core::clip((run / entry).string(), 300), ec.message());
  }
  core::log::warn(
      "experiment.overwrite=true: deleted the earlier run's checkpoints (newest: {}), metrics, "
      "plots and config in '{}'",
      found, core::clip(run.string(), 300));
}

// The run directory itself may be a symbolic link (to a bigger disk, say): a WARN names where the
// run goes. A symbolic link among what the job writes inside it is refused: writes through it
// would land elsewhere, silently, in a file that another job or user may own. So is one among the
// checkpoints (which a resume reads and the retention deletes) that leads out of checkpoints/; a
// `latest` linked to a step directory beside it is a form checkpoint readers accept.
void check_links(const fs::path& run) {
  std::error_code ec;
  if (fs::is_symlink(run, ec)) {
    core::log::warn("run directory '{}' is a symbolic link: the run writes to '{}'",
                    core::clip(run.string(), 300),
                    core::clip(fs::canonical(run, ec).string(), 300));
  }
  auto refuse = [&](const fs::path& link) {
    std::error_code e;
    const fs::path target = fs::read_symlink(link, e);
    throw_error<IoError>(
        "run directory '{}': '{}' is a symbolic link (to '{}'); a run writes only real files and "
        "folders inside its run directory: remove the link (or move what it points to there)",
        core::clip(run.string(), 300), core::clip(link.lexically_relative(run).string(), 200),
        core::clip(e ? std::string("?") : target.string(), 300));
  };
  for (const char* entry : kWrittenEntries) {
    if (fs::is_symlink(run / entry, ec)) refuse(run / entry);
  }
  const fs::path ckpts = run / "checkpoints";
  if (fs::is_directory(ckpts, ec)) {
    const fs::path root = fs::canonical(ckpts, ec);
    for (fs::directory_iterator it(ckpts, ec), end; !ec && it != end; it.increment(ec)) {
      std::error_code e;
      if (!it->is_symlink(e)) continue;
      const fs::path real = fs::weakly_canonical(it->path(), e);
      if (e || real.parent_path() != root) refuse(it->path());
    }
  }
}

}  // namespace

void check_run_name(const std::string& name) {
  const std::string why = core::path_component_problem(name);
  if (!why.empty()) {
    throw_error<ConfigError>("key 'experiment.name' must be one folder name, got '{}', which {}",
                             core::clip(name), why);
  }
}

RunDirectory::RunDirectory(RunDirectory&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      created_(std::exchange(other.created_, false)),
      uncaught_(other.uncaught_) {}

RunDirectory& RunDirectory::operator=(RunDirectory&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    created_ = std::exchange(other.created_, false);
    uncaught_ = other.uncaught_;
  }
  return *this;
}

RunDirectory::~RunDirectory() {
  // A job that created the directory and fails during start-up leaves none behind: only what it
  // wrote itself is removed, and the directory only when that leaves it empty.
  if (created_ && fd_ >= 0 && std::uncaught_exceptions() > uncaught_) {
    std::error_code ec;
    for (const char* entry : {"config.yaml", "metrics.jsonl"}) fs::remove(path_ / entry, ec);
    for (const char* folder : {"checkpoints", "plots", "profile"})
      fs::remove(path_ / folder, ec);      // only when empty
    fs::remove(path_ / kRunLockFile, ec);  // the lock goes with the descriptor closed below
    ::close(fd_);
    fd_ = -1;
    if (fs::remove(path_, ec)) return;  // only an empty directory is removed
  }
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor of the open file releases the flock
}

RunDirectory RunDirectory::open_local(const ExperimentConfig& cfg, bool fresh) {
  check_run_name(cfg.name);
  fs::path path = fs::path(cfg.output_dir) / cfg.name;
  std::error_code ec;
  const bool existed = fs::exists(path, ec) || fs::is_symlink(path, ec);
  fs::create_directories(path, ec);
  if (ec)
    throw_error<IoError>("cannot create run directory '{}': {}", core::clip(path.string(), 300),
                         ec.message());
  check_links(path);
  const fs::path lock = path / kRunLockFile;
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    throw_error<IoError>("cannot open the lock file '{}' of the run directory: {}",
                         core::clip(lock.string(), 300), errno_text(errno));
  }
  RunDirectory dir(path, fd);  // owns fd from here: closed on every error below
  dir.uncaught_ = std::uncaught_exceptions();
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      throw_error<IoError>(
          "run directory '{}' is in use by another job: {}; wait for it to end or set another "
          "experiment.name",
          core::clip(path.string(), 300), describe_holder(fd));
    }
    throw_error<IoError>("cannot lock '{}': {} (does this file system support flock?)",
                         core::clip(lock.string(), 300), errno_text(err));
  }
  const std::string record = fmt::format("{} {} {}\n", ::getpid(), host_name(), utc_now());
  if (::ftruncate(fd, 0) != 0 ||
      ::pwrite(fd, record.data(), record.size(), 0) != static_cast<ssize_t>(record.size())) {
    throw_error<IoError>("cannot write the lock file '{}': {}", core::clip(lock.string(), 300),
                         errno_text(errno));
  }
  // Checked under the lock: another job may be writing checkpoints until it lets go.
  if (fresh) refuse_or_overwrite(path, cfg);
  dir.created_ = !existed;
  return dir;
}

RunDirectory RunDirectory::open(const ExperimentConfig& cfg, bool fresh, comm::Communicator& world,
                                const c10::Device& device) {
  if (world.size() == 1) return open_local(cfg, fresh);
  // Rank 0 opens (and locks) the directory; every failure of rank 0 reaches the other ranks, as its
  // own message, before any of them goes on.
  std::optional<RunDirectory> dir;
  comm::agree_on(world, device, "", [&]() -> int64_t {
    if (world.rank() == 0) dir.emplace(open_local(cfg, fresh));
    return 0;
  });
  if (dir) return std::move(*dir);
  return RunDirectory(fs::path(cfg.output_dir) / cfg.name, -1);
}

}  // namespace parallax::train
