// Output files that never replace what is not theirs. Every user-facing writer (eval's metrics and
// predictions, export's model, weights and parity files, quantize's report, datagen's and
// convert's folders) checks its targets here before any work, and writes them here.
//
// A target that exists and is not a regular file is not the writer's to replace:
//   - a character device or a FIFO is written through (opened, never created or renamed over) by
//     an OutputRule::kStream output (a single text output such as `eval --out`: `/dev/stdout`
//     pipes, `/dev/full` fails with "No space left on device"), and refused by a kFile output (an
//     HDF5 file, or a file whose siblings are named from its path: they would land beside the
//     device node);
//   - a directory, a socket, a block device or a symbolic link that leads nowhere is refused.
// A regular file (or a symbolic link to one: the file it leads to is replaced, the link kept) is
// replaced atomically: the content goes into a temporary file beside it (unnamed where the file
// system has O_TMPFILE, so not even a killed process leaves one behind), fsync, one rename, fsync
// of the folder. A refusal is a UsageError naming the option and the path, raised before any work;
// a failed write is an IoError naming them and the cause, and leaves nothing behind.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace parallax::core {

// How an output may be written when its target is a character device or a FIFO.
enum class OutputRule {
  kFile,    // refused: the output must be a regular file (or not exist yet)
  kStream,  // written through
};

// Throws UsageError "<what> '<path>' ..." (what: the verb and option, e.g. "eval: --out") unless
// `path` can be written under `rule`: refused are an empty path, a path naming a folder ('dir/',
// '.', '..'), and an existing directory, socket, block device, dangling symbolic link, or (kFile)
// character device or FIFO; `why_file` then says why the output must be a file. Creates nothing.
// Returns true when the target will be written through (a character device or FIFO, kStream).
bool check_output_file(const std::string& what, const std::string& path, OutputRule rule,
                       const std::string& why_file = "");

// Throws UsageError "<what> '<path>' ..." unless `path` is a folder or does not exist (an empty
// path, a file, a device node, a FIFO or a socket is refused). Creates nothing.
void check_output_dir(const std::string& what, const std::string& path);

struct OutputFile {
  std::string what;  // the verb and option, for errors: "eval: --out"
  std::string path;
  std::string text;
  OutputRule rule = OutputRule::kStream;
  std::string why_file;  // kFile: why a device node or FIFO is refused (see check_output_file)
};

// Writes every file of `files` or none: each is checked (check_output_file), the regular files
// are staged beside their targets (complete and fsynced), the write-through targets written
// (stdio flushed first, so that what was printed before comes first), then the staged files
// renamed into place. Any failure throws (IoError naming the option, the path and the cause) and
// removes every staged file and every file and folder this call created. Only a rename that
// fails after others succeeded (rare: the failures of a full disk or a bad path come while
// staging) leaves an existing target it already replaced with its new content.
void write_outputs(const std::vector<OutputFile>& files);
inline void write_output(const OutputFile& file) {
  write_outputs({file});
}

// Atomically replaces the file named `path` with `text` (the internal form, for files inside a
// run or dataset folder): the folder is created, a temporary file beside it written and fsynced,
// `before_rename` run (if it throws, `path` is left as it was), one rename, fsync of the folder. A
// crash leaves the old or the new content. A symbolic link at `path` is itself replaced (never
// what it points to); a directory, device node, FIFO or socket there is refused (IoError). Every
// failure is an IoError naming the path and the cause, and leaves no temporary file.
void write_file_atomic(const std::string& path, const std::string& text,
                       const std::function<void()>& before_rename = nullptr);

// A file that a library writes by name (HDF5), published at its target in one rename. The
// constructor checks the target as a kFile output (UsageError naming `what`) and creates its
// folder; the library writes temp_path(); commit() fsyncs it and renames it over the target
// (fsync of the folder). Destroyed without commit(), the temporary file is removed.
class StagedFile {
 public:
  StagedFile(std::string what, const std::string& target, const std::string& why_file = "");
  ~StagedFile();
  StagedFile(const StagedFile&) = delete;
  StagedFile& operator=(const StagedFile&) = delete;

  const std::string& temp_path() const { return temp_; }
  const std::string& target() const { return target_; }
  void commit();

 private:
  std::string what_, target_, temp_;
  bool committed_ = false;
};

}  // namespace parallax::core
