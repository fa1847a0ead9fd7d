// Random number generation: one seeding policy for every rank and device, and capturable
// generator state so checkpoints resume bit-exactly.
//
// Policy: `seed_all(seed)` seeds the CPU and every CUDA generator with the same value, so model
// initialisation is identical on every rank. Per-rank streams (data order, augmentation, dropout
// across DP ranks) derive their own seeds with `derive_seed(seed, rank, stream)`.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace parallax::core {

// Seeds the CPU generator and the generators of all visible CUDA devices.
void seed_all(uint64_t seed);

// A well-mixed 64-bit seed for (seed, rank, stream): independent streams per rank and purpose.
uint64_t derive_seed(uint64_t seed, uint64_t rank, uint64_t stream);

// The state of the CPU generator and of each CUDA device's default generator (byte tensors).
struct RngState {
  at::Tensor cpu;
  std::vector<at::Tensor> cuda;  // index = device index
};

RngState capture_rng();
// Restores a captured state; throws parallax::Error if the number of CUDA devices differs.
void restore_rng(const RngState& state);

}  // namespace parallax::core
