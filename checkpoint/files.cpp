#include "checkpoint/files.h"

#include "core/error.h"
#include "core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <random>

namespace fs = std::filesystem;

namespace parallax::checkpoint::files {
namespace {

std::string errno_text(int e) {
  return std::strerror(e);
}

}  // namespace

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

void fsync_path(const std::string& path, bool directory) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0)));
  if (fd.get() < 0)
    throw_error<IoError>("cannot open '{}' to sync it: {}", path, errno_text(errno));
  if (::fsync(fd.get()) != 0)
    throw_error<IoError>("cannot sync '{}' to disk: {}", path, errno_text(errno));
}

void write_durable(const std::string& path, const std::string& text) {
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) throw_error<IoError>("cannot create '{}': {}", path, errno_text(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_error<IoError>("cannot write '{}': {}", path, errno_text(errno));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0)
    throw_error<IoError>("cannot sync '{}' to disk: {}", path, errno_text(errno));
  if (::close(fd.release()) != 0)
    throw_error<IoError>("cannot close '{}': {}", path, errno_text(errno));
}

void write_atomic(const std::string& path, const std::string& text,
                  const std::function<void()>& before_rename) {
  // The same durable protocol (temporary file fsynced, then before_rename, one rename, fsync of
  // the folder), shared with every other writer of the tree.
  core::write_file_atomic(path, text, before_rename);
}

std::string read_text(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw_error<IoError>("cannot open '{}': {}", path, errno_text(errno));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_error<IoError>("cannot read '{}': {}", path, errno_text(errno));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

bool move_into_place(const std::string& src, const std::string& dst) {
  if (::rename(src.c_str(), dst.c_str()) == 0) return false;
  const int e = errno;
  if (e != EEXIST && e != ENOTEMPTY)
    throw_error<IoError>("cannot rename '{}' to '{}': {}", src, dst, errno_text(e));
  if (::renameat2(AT_FDCWD, src.c_str(), AT_FDCWD, dst.c_str(), RENAME_EXCHANGE) == 0) return true;
  // No atomic exchange on this filesystem: move the old directory aside first (a reader of `dst`
  // may briefly find nothing; `latest` is rewritten right after by the caller).
  const std::string aside = src + ".old";
  if (::rename(dst.c_str(), aside.c_str()) != 0) {
    throw_error<IoError>("cannot move '{}' aside to '{}': {}", dst, aside, errno_text(errno));
  }
  if (::rename(src.c_str(), dst.c_str()) != 0) {
    throw_error<IoError>("cannot rename '{}' to '{}': {}", src, dst, errno_text(errno));
  }
  if (::rename(aside.c_str(), src.c_str()) != 0) {
    throw_error<IoError>("cannot rename '{}' to '{}': {}", aside, src, errno_text(errno));
  }
  return true;
}

std::string random_hex(int bytes) {
  std::random_device rd;
  std::string out;
  static const char* kDigits = "0123456789abcdef";
  for (int i = 0; i < bytes; ++i) {
    const unsigned v = rd() & 0xffu;
    out += kDigits[v >> 4];
    out += kDigits[v & 15];
  }
  return out;
}

int64_t file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return -1;
  return static_cast<int64_t>(st.st_size);
}

std::string utc_now_iso8601() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace parallax::checkpoint::files
