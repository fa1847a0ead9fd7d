#include "core/files.h"

#include "core/error.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>

namespace parallax::core {
namespace {

namespace stdfs = std::filesystem;

// What a st_mode is, as an error message says it.
const char* output_mode_name(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISLNK(m)) return "a symbolic link";
  return "not a regular file";
}

std::string output_temp_suffix() {
  std::random_device rd;
  static const char* kDigits = "0123456789abcdef";
  std::string out = ".tmp-";
  for (int i = 0; i < 8; ++i) out += kDigits[rd() & 15u];
  return out;
}

std::string output_folder(const std::string& path) {
  const stdfs::path parent = stdfs::path(path).parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// An existing output target, classified.
struct OutputTarget {
  enum Kind { kMissing, kRegular, kStream, kRefused } kind = kMissing;
  std::string path;  // what is written: the path given, or the file a symbolic link leads to
  std::string what;  // kStream, kRefused: "a character device", "a directory", ...
};

OutputTarget classify_output(const std::string& path) {
  OutputTarget t;
  t.path = path;
  struct stat ls {};
  // Not there, or a folder on the way missing or unreadable: creating it reports why.
  if (::lstat(path.c_str(), &ls) != 0) return t;
  struct stat st = ls;
  if (S_ISLNK(ls.st_mode) && ::stat(path.c_str(), &st) != 0) {
    t.kind = OutputTarget::kRefused;
    t.what = fmt::format("a symbolic link that leads nowhere ({})", std::strerror(errno));
    return t;
  }
  if (S_ISREG(st.st_mode)) {
    t.kind = OutputTarget::kRegular;
    if (S_ISLNK(ls.st_mode)) {
      // The file it leads to is replaced, not the link (e.g. /dev/stdout redirected to a file).
      std::error_code ec;
      const stdfs::path real = stdfs::canonical(path, ec);
      if (ec) {
        t.kind = OutputTarget::kRefused;
        t.what = fmt::format("a symbolic link whose file cannot be resolved ({})", ec.message());
      } else {
        t.path = real.string();
      }
    }
    return t;
  }
  t.kind =
      S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode) ? OutputTarget::kStream : OutputTarget::kRefused;
  t.what = output_mode_name(st.st_mode);
  return t;
}

// Closes a descriptor on every path.
struct OutputFd {
  int fd = -1;
  OutputFd() = default;
  OutputFd(const OutputFd&) = delete;
  OutputFd& operator=(const OutputFd&) = delete;
  ~OutputFd() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

// Writes all of `text` to `fd`; returns 0, or the errno of the failure (ENOSPC, EIO ...).
int write_fully(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    done += static_cast<size_t>(n);
  }
  return 0;
}

[[noreturn]] void output_fail(const std::string& label, const std::string& step, int err) {
  if (step.empty()) throw_error<IoError>("{}: {}", label, std::strerror(err));
  throw_error<IoError>("{} ({}): {}", label, step, std::strerror(err));
}

void fsync_folder(const std::string& label, const std::string& dir) {
  OutputFd d;
  d.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d.fd < 0) output_fail(label, fmt::format("opening the folder '{}' to sync it", dir), errno);
  if (::fsync(d.fd) != 0) output_fail(label, fmt::format("syncing the folder '{}'", dir), errno);
}

// A file staged beside the name it replaces: written and fsynced by write(), renamed (or linked)
// into place by publish(). Unnamed (O_TMPFILE) where the file system allows it, so that not even
// a killed process leaves a temporary file; else a named temporary file, removed on every error.
class OutputStage {
 public:
  // `label` opens every error message: "eval: --out 'x': cannot write".
  OutputStage(std::string target, std::string label)
      : target_(std::move(target)), dir_(output_folder(target_)), label_(std::move(label)) {}
  OutputStage(const OutputStage&) = delete;
  OutputStage& operator=(const OutputStage&) = delete;
  ~OutputStage() {
    fd_.reset();
    if (!named_.empty()) ::unlink(named_.c_str());
    if (!published_) remove_made_folders();
  }

  // Undoes this stage: its temporary file, the target if publish() created it, the folders it made.
  void roll_back() {
    fd_.reset();
    if (!named_.empty()) ::unlink(named_.c_str());
    named_.clear();
    if (created_) ::unlink(target_.c_str());
    created_ = false;
    remove_made_folders();
  }

  void write(const std::string& text) {
    // The folders on the way that are missing, made here and removed again on failure.
    for (stdfs::path p = dir_; !p.empty() && p != p.root_path(); p = p.parent_path()) {
      std::error_code ec;
      if (stdfs::symlink_status(p, ec).type() != stdfs::file_type::not_found) break;
      made_.push_back(p.string());
    }
    std::error_code ec;
    stdfs::create_directories(dir_, ec);  // an error shows when the file is created in it
#ifdef O_TMPFILE
    fd_.fd = ::open(dir_.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0644);
    if (fd_.fd >= 0 && ::access("/proc/self/fd", X_OK) != 0) fd_.reset();  // cannot link it
#endif
    if (fd_.fd < 0) {
      const std::string tmp = target_ + output_temp_suffix();
      fd_.fd = ::open(tmp.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
      if (fd_.fd < 0) output_fail(label_, fmt::format("creating '{}'", tmp), errno);
      named_ = tmp;
    }
    if (const int e = write_fully(fd_.fd, text)) output_fail(label_, "", e);
    if (::fsync(fd_.fd) != 0) output_fail(label_, "syncing", errno);
    if (!named_.empty()) {
      const int fd = fd_.fd;
      fd_.fd = -1;
      if (::close(fd) != 0) output_fail(label_, fmt::format("closing '{}'", named_), errno);
    }
  }

  // Makes the staged file visible at the target: a target that exists is replaced in one rename.
  void publish() {
    if (named_.empty()) {
      const std::string proc = fmt::format("/proc/self/fd/{}", fd_.fd);
      if (::linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, target_.c_str(), AT_SYMLINK_FOLLOW) == 0) {
        created_ = published_ = true;
        fd_.reset();
        fsync_folder(label_, dir_);
        return;
      }
      if (errno != EEXIST) output_fail(label_, "linking the new file into place", errno);
      const std::string tmp = target_ + output_temp_suffix();
      if (::linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, tmp.c_str(), AT_SYMLINK_FOLLOW) != 0)
        output_fail(label_, fmt::format("linking the new file at '{}'", tmp), errno);
      named_ = tmp;
      fd_.reset();
    }
    // What is at the target now must still be a file this writer may replace.
    struct stat st {};
    const bool existed = ::lstat(target_.c_str(), &st) == 0;
    if (existed && !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode)) {
      throw_error<IoError>("{}: it is {} (not replaced)", label_, output_mode_name(st.st_mode));
    }
    if (::rename(named_.c_str(), target_.c_str()) != 0)
      output_fail(label_, fmt::format("renaming '{}' over it", named_), errno);
    named_.clear();
    created_ = !existed;
    published_ = true;
    fsync_folder(label_, dir_);
  }

 private:
  void remove_made_folders() {
    for (const auto& d : made_) ::rmdir(d.c_str());  // deepest first; a folder not empty stays
    made_.clear();
  }

  std::string target_, dir_, label_;
  std::string named_;              // the temporary file's name, while it has one
  std::vector<std::string> made_;  // folders write() made, deepest first
  OutputFd fd_;
  bool created_ = false;  // publish() created the target (it was not there before)
  bool published_ = false;
};

// Writes `text` through the character device or FIFO at `path` (never created, truncated or
// renamed over).
void write_through(const std::string& label, const std::string& path, const std::string& text) {
  OutputFd out;
  out.fd = ::open(path.c_str(), O_WRONLY | O_NOCTTY | O_CLOEXEC);
  if (out.fd < 0) output_fail(label, "opening", errno);
  struct stat st {};
  if (::fstat(out.fd, &st) != 0) output_fail(label, "stat", errno);
  if (!S_ISCHR(st.st_mode) && !S_ISFIFO(st.st_mode))
    throw_error<IoError>("{}: it is now {} (not written)", label, output_mode_name(st.st_mode));
  if (const int e = write_fully(out.fd, text)) output_fail(label, "", e);
  // Devices and FIFOs have nothing to sync (EINVAL); a device that has reports its error.
  if (::fsync(out.fd) != 0 && errno != EINVAL && errno != EROFS && errno != ENOTSUP)
    output_fail(label, "syncing", errno);
  const int fd = out.fd;
  out.fd = -1;
  if (::close(fd) != 0 && errno != EINTR) output_fail(label, "closing", errno);
}

}  // namespace

bool check_output_file(const std::string& what, const std::string& path, OutputRule rule,
                       const std::string& why_file) {
  PARALLAX_CHECK(!path.empty(), UsageError, "{} '' is an empty path; give a file path", what);
  const std::string name = stdfs::path(path).filename().string();
  PARALLAX_CHECK(!name.empty() && name != "." && name != "..", UsageError,
                 "{} '{}' names a folder; give a file path", what, path);
  const OutputTarget t = classify_output(path);
  PARALLAX_CHECK(t.kind != OutputTarget::kRefused, UsageError,
                 "{} '{}' is {}; it is not replaced: give a file path", what, path, t.what);
  if (t.kind == OutputTarget::kStream && rule == OutputRule::kFile) {
    throw_error<UsageError>("{} '{}' is {}: {}; give a regular file path", what, path, t.what,
                            why_file.empty() ? "this output must be a regular file" : why_file);
  }
  return t.kind == OutputTarget::kStream;
}

void check_output_dir(const std::string& what, const std::string& path) {
  PARALLAX_CHECK(!path.empty(), UsageError, "{} '' is an empty path; give a folder path", what);
  struct stat ls {};
  if (::lstat(path.c_str(), &ls) != 0) return;  // created by the writer, which reports failures
  struct stat st {};
  PARALLAX_CHECK(::stat(path.c_str(), &st) == 0, UsageError,
                 "{} '{}' is a symbolic link that leads nowhere; give a folder path", what, path);
  PARALLAX_CHECK(S_ISDIR(st.st_mode), UsageError, "{} '{}' is {}, not a folder; give a folder path",
                 what, path, output_mode_name(st.st_mode));
}

void write_outputs(const std::vector<OutputFile>& files) {
  std::vector<OutputTarget> targets;
  for (const auto& f : files) {
    check_output_file(f.what, f.path, f.rule, f.why_file);
    targets.push_back(classify_output(f.path));
  }
  std::vector<std::unique_ptr<OutputStage>> stages(files.size());
  auto label = [&](size_t i) {
    return fmt::format("{} '{}': cannot write", files[i].what, files[i].path);
  };
  try {
    for (size_t i = 0; i < files.size(); ++i) {
      if (targets[i].kind == OutputTarget::kStream) continue;
      stages[i] = std::make_unique<OutputStage>(targets[i].path, label(i));
      stages[i]->write(files[i].text);
    }
    std::fflush(nullptr);
    for (size_t i = 0; i < files.size(); ++i) {
      if (targets[i].kind == OutputTarget::kStream)
        write_through(label(i), targets[i].path, files[i].text);
    }
    for (auto& s : stages) {
      if (s) s->publish();
    }
  } catch (...) {
    for (auto it = stages.rbegin(); it != stages.rend(); ++it) {
      if (*it) (*it)->roll_back();
    }
    throw;
  }
}

void write_file_atomic(const std::string& path, const std::string& text,
                       const std::function<void()>& before_rename) {
  const std::string label = fmt::format("cannot write '{}'", path);
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode))
    throw_error<IoError>("{}: it is {} (not replaced)", label, output_mode_name(st.st_mode));
  OutputStage stage(path, label);
  stage.write(text);
  if (before_rename) before_rename();
  stage.publish();
}

StagedFile::StagedFile(std::string what, const std::string& target, const std::string& why_file)
    : what_(std::move(what)) {
  check_output_file(what_, target, OutputRule::kFile, why_file);
  target_ = classify_output(target).path;
  const std::string dir = output_folder(target_);
  std::error_code ec;
  stdfs::create_directories(dir, ec);
  if (ec) {
    throw_error<IoError>("{} '{}': cannot create the folder '{}': {}", what_, target, dir,
                         ec.message());
  }
  temp_ = target_ + output_temp_suffix();
}

StagedFile::~StagedFile() {
  if (!committed_) ::unlink(temp_.c_str());
}

void StagedFile::commit() {
  const std::string label = fmt::format("{} '{}': cannot write", what_, target_);
  {
    OutputFd f;
    f.fd = ::open(temp_.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.fd < 0) output_fail(label, fmt::format("opening '{}' to sync it", temp_), errno);
    if (::fsync(f.fd) != 0) output_fail(label, fmt::format("syncing '{}'", temp_), errno);
  }
  struct stat st {};
  if (::lstat(target_.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    throw_error<IoError>("{}: it is {} (not replaced)", label, output_mode_name(st.st_mode));
  if (::rename(temp_.c_str(), target_.c_str()) != 0)
    output_fail(label, fmt::format("renaming '{}' over it", temp_), errno);
  committed_ = true;
  fsync_folder(label, output_folder(target_));
}

}  // namespace parallax::core
