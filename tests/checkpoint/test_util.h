// Helpers shared by the checkpoint tests: fresh random tensors of any dtype, bitwise comparison,
// scratch directories, and ranks simulated by threads.
#pragma once

#include <ATen/ATen.h>

#include <exception>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace parallax::ckpt_test {

// A random tensor of `dtype` and `shape` drawn from `gen` (never all zeros for numel > 1).
inline at::Tensor random_tensor(at::ScalarType dtype, const std::vector<int64_t>& shape,
                                at::Generator gen) {
  const auto f = at::TensorOptions().dtype(at::kFloat);
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
      return at::randn(shape, gen, f).mul_(3).to(dtype);
    case at::kBool:
      return at::randint(0, 2, shape, gen, at::TensorOptions().dtype(at::kLong)).to(at::kBool);
    case at::kByte:
      return at::randint(0, 256, shape, gen, at::TensorOptions().dtype(at::kLong)).to(dtype);
    case at::kChar:
      return at::randint(-128, 128, shape, gen, at::TensorOptions().dtype(at::kLong)).to(dtype);
    default:
      return at::randint(-(int64_t{1} << 40), int64_t{1} << 40, shape, gen,
                         at::TensorOptions().dtype(at::kLong))
          .to(dtype);
  }
}

// Bitwise equality (NaN payloads included): same dtype, shape and bytes.
inline bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor x = a.cpu().contiguous(), y = b.cpu().contiguous();
  if (x.numel() == 0) return true;
  return std::memcmp(x.const_data_ptr(), y.const_data_ptr(), x.nbytes()) == 0;
}

// A fresh directory under the system temp dir, removed on destruction.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag) {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("parallax_ckpt_" + tag + "_" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string str() const { return path_.string(); }
  std::filesystem::path operator/(const std::string& p) const { return path_ / p; }

 private:
  std::filesystem::path path_;
};

// Runs fn(rank) on `world` threads (ranks of one checkpoint group sharing a c10d HashStore),
// rethrowing the first failure once all have finished.
inline void run_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

inline uint64_t fresh_seed() {
  return std::random_device{}() * 0x9E3779B97F4A7C15ULL + std::random_device{}();
}

// Whether `part` occurs in `s` (error messages name files, tensors and ranks).
inline bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace parallax::ckpt_test
