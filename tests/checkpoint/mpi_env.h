// What the multi-rank checkpoint tests share: the world communicator created by mpi_main.cpp and
// the `--dir=` argument. Test scaffolding only.
#pragma once

#include "comm/communicator.h"
#include "comm/world.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <random>
#include <string>

namespace parallax::ckpt_test {

struct MpiEnv {
  comm::CommPtr comm;
  std::string dir;
  static MpiEnv& get();

  int rank() const { return comm->rank(); }
  int size() const { return comm->size(); }
  void barrier() { comm->barrier(); }
  // A fresh random value chosen on rank 0, the same on every rank.
  uint64_t shared_seed() {
    at::Tensor t = at::zeros({1}, at::kLong);
    if (rank() == 0)
      t.fill_(static_cast<int64_t>((std::random_device{}() << 16) ^ std::random_device{}()));
    comm->broadcast(t, 0);
    return static_cast<uint64_t>(t.item<int64_t>());
  }
  // A string of rank 0, the same on every rank.
  std::string shared_string(const std::string& value) {
    at::Tensor n = at::full({1}, static_cast<int64_t>(value.size()), at::kLong);
    comm->broadcast(n, 0);
    at::Tensor bytes = at::zeros({n.item<int64_t>()}, at::kByte);
    if (rank() == 0 && !value.empty()) std::memcpy(bytes.data_ptr(), value.data(), value.size());
    if (bytes.numel() > 0) comm->broadcast(bytes, 0);
    return std::string(static_cast<const char*>(bytes.const_data_ptr()),
                       static_cast<size_t>(bytes.numel()));
  }
};

// The chunk of `n` elements that part `i` of `parts` holds (the first n % parts get one more).
inline std::pair<int64_t, int64_t> chunk(int64_t n, int parts, int i) {
  const int64_t base = n / parts, rem = n % parts;
  return {i * base + std::min<int64_t>(i, rem), base + (i < rem ? 1 : 0)};
}

}  // namespace parallax::ckpt_test
