// Which scenes each data-parallel rank reads, epoch by epoch.
//
// Every rank computes the same permutation of [0, size) for an epoch (from seed and epoch only; a
// fixed permutation-free order when shuffle is off) and takes every world-th element starting at
// its rank: the ranks' lists are disjoint and together cover the split exactly once, with sizes
// differing by at most one. `num_batches` is the same on every rank when `drop_last` is set (the
// ranks step in lockstep through their collectives; each rank drops the tail of its list), and is
// ceil(|list| / batch) otherwise (evaluation: every scene once, ranks may differ by one batch).
//
// With class-balanced groups (data.sampler=cbgs, data/cbgs.h) an epoch is a fresh class-balanced
// draw of scene slots (repeats allowed) instead of a permutation; each scene's copies go to one
// rank, and every rank reads the same number of slots (floor(slots / world)).
// Immutable after construction; thread-safe.
#pragma once

#include "data/cbgs.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace parallax::data {

class DistributedSampler {
 public:
  DistributedSampler(int64_t size, int rank, int world, bool shuffle, uint64_t seed);
  // Class-balanced (data/cbgs.h): size() is the epoch's slot count.
  DistributedSampler(std::shared_ptr<const CbgsGroups> groups, int rank, int world, uint64_t seed);

  // This rank's scene indices for `epoch`, in reading order.
  std::vector<int64_t> indices(int64_t epoch) const;
  // The length of indices(epoch) (the same every epoch).
  int64_t rank_size() const;
  // Batches of this rank per epoch.
  int64_t num_batches(int64_t batch_size, bool drop_last) const;
  // Samples of this rank's list used per epoch (num_batches * batch_size, or rank_size() without
  // drop_last).
  int64_t samples_used(int64_t batch_size, bool drop_last) const;

  int64_t size() const { return size_; }
  int rank() const { return rank_; }
  int world() const { return world_; }

 private:
  int64_t size_;
  int rank_, world_;
  bool shuffle_;
  uint64_t seed_;
  std::shared_ptr<const CbgsGroups> groups_;  // null: a permutation per epoch
};

}  // namespace parallax::data
