// The Parallax exception hierarchy. Library code reports every failure by throwing one of these
// with a message that names the file, key, rank or value involved; the CLI boundary catches them
// once, prints `parallax: error: <what()>` and exits non-zero. Library code never exits.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace parallax {

// Base of all Parallax errors. `context()` lists "where" frames added while the exception
// propagated (outermost last), e.g. "while loading configs/bev_tiny.yaml".
class Error : public std::runtime_error {
 public:
  explicit Error(std::string message) : std::runtime_error(message), message_(std::move(message)) {}

  // Adds a frame of context; what() then reads "<message> (<frame1>; <frame2>)".
  Error& add_context(std::string frame);
  const std::vector<std::string>& context() const { return context_; }
  const std::string& message() const { return message_; }
  const char* what() const noexcept override {
    return full_.empty() ? message_.c_str() : full_.c_str();
  }

 private:
  std::string message_;
  std::string full_;
  std::vector<std::string> context_;
};

// Malformed, unknown or invalid configuration (file, key path, value in the message).
class ConfigError : public Error {
 public:
  using Error::Error;
};

// Bad command-line usage (unknown flag, missing argument).
class UsageError : public Error {
 public:
  using Error::Error;
};

// A communication failure: collective mismatch, peer failure, backend error.
class CommError : public Error {
 public:
  using Error::Error;
};

// A blocking wait exceeded its deadline (collective, rendezvous, barrier).
class TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

// Impossible parallel layout (dp * tp * pp != world, tp > GPUs per node, ...).
class LayoutError : public Error {
 public:
  using Error::Error;
};

// Dataset problems: missing file, corrupt/truncated HDF5, schema mismatch.
class DataError : public Error {
 public:
  using Error::Error;
};

// Checkpoint problems: missing shard, checksum mismatch, version mismatch.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

// Training numerics: NaN/inf loss, loss scale collapse.
class NumericsError : public Error {
 public:
  using Error::Error;
};

// Filesystem problems (cannot create, write, rename; disk full).
class IoError : public Error {
 public:
  using Error::Error;
};

// Throws E with an fmt-formatted message: `throw_error<ConfigError>("{}: bad key '{}'", f, k)`.
template <class E = Error, class... Args>
[[noreturn]] void throw_error(fmt::format_string<Args...> f, Args&&... args) {
  throw E(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace parallax

// Checks a condition that depends on user input or the environment; throws `E` if false.
#define PARALLAX_CHECK(cond, E, ...)                      \
  do {                                                    \
    if (!(cond)) ::parallax::throw_error<E>(__VA_ARGS__); \
  } while (0)
