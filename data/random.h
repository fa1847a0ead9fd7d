// A small, fully specified random number generator for the data layer (scene generation, shuffling,
// augmentation). The standard library's distributions are implementation-defined, so they may
// differ between standard libraries; everything here is defined bit for bit (xoshiro256** seeded
// through SplitMix64, 53-bit uniform doubles, Box-Muller normals without caching), so a seed gives
// the same scenes, orders and augmentations on every platform with the same floating-point
// library. Not thread-safe: give every thread (or every scene) its own generator.
#pragma once

#include <cmath>
#include <cstdint>

namespace parallax::data {

class Rng {
 public:
  explicit Rng(uint64_t seed) {
    uint64_t x = seed;
    for (auto& s : s_) s = splitmix(x);
  }

  uint64_t next_u64() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  // Uniform in [lo, hi).
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  // Uniform integer in [0, n) (n > 0), unbiased (rejection of the short top range).
  uint64_t below(uint64_t n) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do x = next_u64();
    while (x >= limit);
    return x % n;
  }
  // Uniform integer in [lo, hi] (inclusive).
  int64_t range(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(below(static_cast<uint64_t>(hi - lo + 1)));
  }
  bool bernoulli(double p) { return uniform() < p; }
  // Standard normal by Box-Muller (one value per call; no cached second value, so the stream
  // does not depend on call history beyond the count of draws).
  double normal() {
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  double normal(double mean, double stddev) { return mean + stddev * normal(); }
  // Normal clamped to [lo, hi].
  double normal_clamped(double mean, double stddev, double lo, double hi) {
    const double v = normal(mean, stddev);
    return v < lo ? lo : (v > hi ? hi : v);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  static uint64_t splitmix(uint64_t& x) {
    uint64_t z = (x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

  uint64_t s_[4];
};

// Stream identifiers for core::derive_seed(seed, index, stream) in the data layer.
enum class SeedStream : uint64_t {
  kSplit = 101,      // per split: the split's base seed
  kScene = 102,      // per scene: layout, objects, rig jitter, lighting
  kShuffle = 103,    // per epoch: the sampler's permutation
  kAugment = 104,    // per (epoch, scene): augmentation parameters
  kMotion = 105,     // per sequence: the ego's and the objects' speeds (data/sequence_gen.h)
  kCbgsDraw = 110,   // per epoch: the class-balanced draw (data/cbgs.h)
  kCbgsSplit = 111,  // per epoch: its split across ranks and each rank's order
};

}  // namespace parallax::data
