// Helpers shared by the multi-rank comm tests: the process World and world communicator of the
// backend under test ($PARALLAX_TEST_BACKEND: auto|mpi|gloo|nccl), the device its tensors live on,
// and reproducible random inputs every rank can regenerate for every other rank.
#pragma once

#include "comm/communicator.h"
#include "comm/factory.h"
#include "comm/world.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdlib>
#include <string>

namespace parallax::comm::testing {

inline std::string test_backend() {
  const char* b = std::getenv("PARALLAX_TEST_BACKEND");
  return b && *b ? b : "auto";
}

inline CommPtr& world_comm_slot() {
  static CommPtr comm;
  return comm;
}

// Options of the test communicators: a hang becomes a TimeoutError (with its hang report) after
// $PARALLAX_TEST_TIMEOUT seconds (default 60) instead of stalling ctest.
inline CommOptions test_options() {
  CommOptions o;
  const char* t = std::getenv("PARALLAX_TEST_TIMEOUT");
  o.timeout_s = t && *t ? std::atof(t) : 60.0;
  return o;
}

// The world communicator of the backend under test, created on first use (collectively).
inline CommPtr& world_comm() {
  CommPtr& c = world_comm_slot();
  if (!c) c = make_world_communicator(test_backend(), test_options());
  return c;
}

inline c10::Device test_device() {
  return resolve_backend(test_backend(), World::current()) == "nccl" ? *World::current().device()
                                                                     : c10::Device(c10::kCPU);
}

// Fresh, reproducible values: normal floats rounded to `dtype` (so that they are exact in it), or
// integers in [-1000, 1000). Never all zeros.
inline at::Tensor random_input(int64_t numel, c10::ScalarType dtype, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  if (at::isIntegralType(dtype, false))
    return at::randint(-1000, 1000, {numel}, gen, at::kLong).to(dtype);
  return at::randn({numel}, gen, at::kFloat).to(dtype);
}

inline uint64_t seed_of(uint64_t test_case, int rank) {
  return 0x9E3779B97F4A7C15ULL * (test_case + 1) + 7919ULL * rank;
}

}  // namespace parallax::comm::testing
