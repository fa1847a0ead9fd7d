// Internal: the durable-filesystem primitives that the atomic commit is built from (POSIX; every
// failure is an IoError naming the path and strerror, e.g. "No space left on device").
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace parallax::checkpoint::files {

// Closes a file descriptor on scope exit (callers check the errors of a final close themselves,
// after release()).
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd();
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int f = fd_;
    fd_ = -1;
    return f;
  }

 private:
  int fd_;
};

// fsync of a file or a directory (so that renames and creations inside it are durable).
void fsync_path(const std::string& path, bool directory);
// Writes `text` to `path` (created or truncated), fsyncs and closes it.
void write_durable(const std::string& path, const std::string& text);
// Atomically replaces `path` with `text`: a temporary file beside it, fsync, rename over `path`,
// fsync of the directory. A crash leaves either the old or the new content. `before_rename`, if
// given, runs once the temporary file is durable; if it throws, `path` is left as it was. A
// directory, device node, FIFO or socket at `path` is refused (core::write_file_atomic).
void write_atomic(const std::string& path, const std::string& text,
                  const std::function<void()>& before_rename = nullptr);
// Whole file as a string; throws E-less IoError naming the path.
std::string read_text(const std::string& path);
// Moves directory `src` to `dst`. If `dst` exists it is atomically exchanged with `src`
// (renameat2 RENAME_EXCHANGE; `src` then holds the old content, which the caller deletes), so a
// reader of `dst` sees the old or the new directory, never none. Returns true if an exchange
// happened. Where the filesystem cannot exchange, the old `dst` is first moved to `src + ".old"`.
bool move_into_place(const std::string& src, const std::string& dst);
// Lower-case hex of `bytes` random bytes (std::random_device).
std::string random_hex(int bytes);
// Size of a regular file in bytes, or -1 if it does not exist.
int64_t file_size(const std::string& path);
// "2025-01-31T12:00:00Z"
std::string utc_now_iso8601();

}  // namespace parallax::checkpoint::files
