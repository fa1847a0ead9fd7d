#include "data/sampler.h"

#include "core/error.h"
#include "core/rng.h"
#include "data/random.h"

#include <numeric>

namespace parallax::data {

DistributedSampler::DistributedSampler(int64_t size, int rank, int world, bool shuffle,
                                       uint64_t seed)
    : size_(size), rank_(rank), world_(world), shuffle_(shuffle), seed_(seed) {
  if (size < 0 || world < 1 || rank < 0 || rank >= world) {
    throw_error<DataError>("sampler: invalid size {} / rank {} / world {}", size, rank, world);
  }
}

DistributedSampler::DistributedSampler(std::shared_ptr<const CbgsGroups> groups, int rank,
                                       int world, uint64_t seed)
    : DistributedSampler(groups ? groups->epoch_slots : 0, rank, world, true, seed) {
  groups_ = std::move(groups);
}

std::vector<int64_t> DistributedSampler::indices(int64_t epoch) const {
  if (groups_) {
    return cbgs_rank_slots(cbgs_draw(*groups_, seed_, epoch), rank_, world_, rank_size(), seed_,
                           epoch);
  }
  std::vector<int64_t> perm(static_cast<size_t>(size_));
  std::iota(perm.begin(), perm.end(), 0);
  if (shuffle_) {
    // Fisher-Yates with a fully specified generator: the same order on every rank and platform.
    Rng rng(core::derive_seed(seed_, static_cast<uint64_t>(epoch),
                              static_cast<uint64_t>(SeedStream::kShuffle)));
    for (int64_t i = size_ - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i + 1)));
      std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(j)]);
    }
  }
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(rank_size()));
  for (int64_t i = rank_; i < size_; i += world_) mine.push_back(perm[static_cast<size_t>(i)]);
  return mine;
}

int64_t DistributedSampler::rank_size() const {
  if (groups_) return size_ / world_;  // every rank the same
  return size_ / world_ + (rank_ < size_ % world_ ? 1 : 0);
}

int64_t DistributedSampler::num_batches(int64_t batch_size, bool drop_last) const {
  if (drop_last) return (size_ / world_) / batch_size;  // the smallest rank's full batches
  return (rank_size() + batch_size - 1) / batch_size;
}

int64_t DistributedSampler::samples_used(int64_t batch_size, bool drop_last) const {
  return drop_last ? num_batches(batch_size, true) * batch_size : rank_size();
}

}  // namespace parallax::data
