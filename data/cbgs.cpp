#include "data/cbgs.h"

#include "core/error.h"
#include "core/rng.h"
#include "data/random.h"

#include <algorithm>
#include <map>
#include <numeric>

namespace parallax::data {
namespace {

// Fisher-Yates with the data layer's generator: the same order on every platform.
template <class T>
void shuffle(std::vector<T>& v, Rng& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng.below(i)]);
}

}  // namespace

CbgsGroups cbgs_groups(const std::vector<std::vector<int>>& scene_classes, int num_classes) {
  CbgsGroups g;
  g.scenes.resize(static_cast<size_t>(std::max(num_classes, 0)));
  for (size_t i = 0; i < scene_classes.size(); ++i) {
    std::vector<int> cls = scene_classes[i];
    std::sort(cls.begin(), cls.end());
    cls.erase(std::unique(cls.begin(), cls.end()), cls.end());
    for (int c : cls) {
      if (c >= 0 && c < num_classes)
        g.scenes[static_cast<size_t>(c)].push_back(static_cast<int64_t>(i));
    }
  }
  int64_t total = 0, groups = 0;
  for (const auto& s : g.scenes) {
    total += static_cast<int64_t>(s.size());
    groups += s.empty() ? 0 : 1;
  }
  if (groups == 0) {
    throw_error<DataError>(
        "data.sampler=cbgs: none of the split's {} scenes holds a visible box of a class, so "
        "there is nothing to balance",
        scene_classes.size());
  }
  g.draws_per_class = total / groups;
  g.epoch_slots = g.draws_per_class * groups;
  return g;
}

std::vector<int64_t> cbgs_draw(const CbgsGroups& g, uint64_t seed, int64_t epoch) {
  Rng rng(core::derive_seed(seed, static_cast<uint64_t>(epoch),
                            static_cast<uint64_t>(SeedStream::kCbgsDraw)));
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(g.epoch_slots));
  for (const auto& scenes : g.scenes) {
    if (scenes.empty()) continue;
    for (int64_t k = 0; k < g.draws_per_class; ++k) out.push_back(scenes[rng.below(scenes.size())]);
  }
  return out;
}

std::vector<int64_t> cbgs_rank_slots(const std::vector<int64_t>& draw, int rank, int world,
                                     int64_t rank_slots, uint64_t seed, int64_t epoch) {
  std::map<int64_t, int64_t> copies;
  for (int64_t s : draw) ++copies[s];
  if (static_cast<int64_t>(copies.size()) < world) {
    throw_error<DataError>(
        "data.sampler=cbgs: the epoch drew {} distinct scenes for {} data-parallel ranks; every "
        "rank needs scenes of its own (use fewer ranks or more scenes)",
        copies.size(), world);
  }
  // The same seeded order on every rank, then largest count first (stable: the seeded order
  // breaks ties), each to the least-loaded rank.
  std::vector<std::pair<int64_t, int64_t>> scenes(copies.begin(), copies.end());
  Rng rng(core::derive_seed(seed, static_cast<uint64_t>(epoch),
                            static_cast<uint64_t>(SeedStream::kCbgsSplit)));
  shuffle(scenes, rng);
  std::stable_sort(scenes.begin(), scenes.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  std::vector<int64_t> mine;
  for (const auto& [scene, n] : scenes) {
    const auto r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[static_cast<size_t>(r)] += n;
    if (r == rank) mine.insert(mine.end(), static_cast<size_t>(n), scene);
  }
  // This rank's order: its own stream, so ranks do not share an order.
  Rng order(core::derive_seed(
      seed, static_cast<uint64_t>(epoch) * 65536 + 1 + static_cast<uint64_t>(rank),
      static_cast<uint64_t>(SeedStream::kCbgsSplit)));
  shuffle(mine, order);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(rank_slots));
  for (int64_t i = 0; i < rank_slots; ++i)
    out.push_back(mine[static_cast<size_t>(i) % mine.size()]);
  return out;
}

}  // namespace parallax::data
