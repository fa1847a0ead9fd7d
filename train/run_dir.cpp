#include "train/run_dir.h"

#include "core/error.h"
#include "core/strings.h"
#include "parallel/comm/communicator.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <optional>
#include <sstream>
#include <utility>

namespace fs = std::filesystem;

namespace parallax::train {
namespace {

// Room for rank 0's outcome in the broadcast: a kind byte, then the message, NUL-terminated.
constexpr int64_t kOutcomeBytes = 1024;
enum Outcome : uint8_t { kOk = 0, kIoError = 1, kConfigError = 2 };

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

}  // namespace

void check_run_name(const std::string& name) {
  const std::string why = core::path_component_problem(name);
  if (!why.empty()) {
    throw_error<ConfigError>("key 'experiment.name' must be one folder name, got '{}', which {}",
                             core::clip(name), why);
  }
}

RunDirectory::RunDirectory(RunDirectory&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

RunDirectory& RunDirectory::operator=(RunDirectory&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

RunDirectory::~RunDirectory() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor of the open file releases the flock
}

RunDirectory RunDirectory::open_local(const ExperimentConfig& cfg) {
  check_run_name(cfg.name);
  fs::path path = fs::path(cfg.output_dir) / cfg.name;
  std::error_code ec;
  fs::create_directories(path, ec);
  if (ec)
    throw_error<IoError>("cannot create run directory '{}': {}", core::clip(path.string(), 300),
                         ec.message());
  const fs::path lock = path / kRunLockFile;
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw_error<IoError>("cannot open the lock file '{}' of the run directory: {}",
                         core::clip(lock.string(), 300), errno_text(errno));
  }
  RunDirectory dir(path, fd);  // owns fd from here: closed on every error below
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
  return dir;
}

RunDirectory RunDirectory::open(const ExperimentConfig& cfg, parallel::comm::Communicator& world,
                                const c10::Device& device) {
  if (world.size() == 1) return open_local(cfg);
  std::optional<RunDirectory> dir;
  Outcome outcome = kOk;
  std::string message;
  if (world.rank() == 0) {
    // Every failure of rank 0 reaches the other ranks; only then does rank 0 throw it too.
    try {
      dir.emplace(open_local(cfg));
    } catch (const ConfigError& e) {
      outcome = kConfigError;
      message = e.what();
    } catch (const std::exception& e) {
      outcome = kIoError;
      message = e.what();
    }
  }
  at::Tensor host = at::zeros({kOutcomeBytes}, at::kByte);
  if (world.rank() == 0) {
    const std::string text = core::clip(message, kOutcomeBytes - 32);
    auto* p = host.data_ptr<uint8_t>();
    p[0] = outcome;
    std::memcpy(p + 1, text.data(), std::min<std::size_t>(text.size(), kOutcomeBytes - 2));
  }
  at::Tensor buf = host.to(device);
  world.broadcast_async(buf, 0)->wait();
  host = buf.cpu();
  const auto* p = host.data_ptr<uint8_t>();
  const auto received = static_cast<Outcome>(p[0]);
  if (received != kOk) {
    message.assign(reinterpret_cast<const char*>(p + 1),
                   strnlen(reinterpret_cast<const char*>(p + 1), kOutcomeBytes - 1));
    if (received == kConfigError) throw ConfigError(message);
    throw IoError(message);
  }
  if (dir) return std::move(*dir);
  return RunDirectory(fs::path(cfg.output_dir) / cfg.name, -1);
}

}  // namespace parallax::train
