#include "checkpoint/save_state.h"

#include "checkpoint/h5.h"
#include "core/boxes.h"
#include "core/error.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>

namespace parallax::checkpoint {

void SaveState::add_replicated(const std::string& name, const at::Tensor& tensor,
                               std::vector<int> replicas) {
  TensorEntry e;
  e.name = name;
  e.tensor = tensor;
  if (tensor.defined()) e.global_shape = tensor.sizes().vec();
  e.offsets.assign(e.global_shape.size(), 0);
  e.kind = replicas.empty() ? TensorEntry::Kind::kReplicatedAll : TensorEntry::Kind::kExplicit;
  e.replicas = std::move(replicas);
  entries_.push_back(std::move(e));
}

void SaveState::add_shard(const std::string& name, const at::Tensor& tensor,
                          std::vector<int64_t> global_shape, std::vector<int64_t> offsets,
                          std::vector<int> replicas) {
  TensorEntry e;
  e.name = name;
  e.tensor = tensor;
  e.global_shape = std::move(global_shape);
  e.offsets = std::move(offsets);
  e.replicas = std::move(replicas);
  e.kind = TensorEntry::Kind::kExplicit;
  entries_.push_back(std::move(e));
}

void SaveState::add_flat_shard(const std::string& name, const at::Tensor& tensor,
                               std::vector<int64_t> global_shape, int64_t begin,
                               std::vector<int> replicas) {
  TensorEntry e;
  e.name = name;
  e.tensor = tensor;
  e.global_shape = std::move(global_shape);
  const int64_t n = tensor.defined() ? tensor.numel() : 0;
  e.flat = FlatRange{begin, begin + n};
  e.replicas = std::move(replicas);
  e.kind = TensorEntry::Kind::kExplicit;
  entries_.push_back(std::move(e));
}

void SaveState::add_rank_local(const std::string& name, const at::Tensor& tensor) {
  TensorEntry e;
  e.name = name;
  e.tensor = tensor;
  if (tensor.defined()) e.global_shape = tensor.sizes().vec();
  e.offsets.assign(e.global_shape.size(), 0);
  e.kind = TensorEntry::Kind::kRankLocal;
  entries_.push_back(std::move(e));
}

void SaveState::set_extra(const std::string& key, int64_t value) {
  extra_[key] = value;
}

void SaveState::set_extra(const std::string& key, double value) {
  if (!std::isfinite(value))
    throw_error<CheckpointError>("checkpoint extra '{}' is not finite ({})", key, value);
  extra_[key] = value;
}

void SaveState::set_extra(const std::string& key, const std::string& value) {
  extra_[key] = value;
}

int64_t SaveState::nbytes() const {
  int64_t n = 0;
  for (const auto& e : entries_)
    n += e.tensor.defined() ? static_cast<int64_t>(e.tensor.nbytes()) : 0;
  return n;
}

std::vector<int> balance_owners(const std::vector<int64_t>& bytes,
                                const std::vector<std::string>& names, int members) {
  std::vector<size_t> order(bytes.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (bytes[a] != bytes[b]) return bytes[a] > bytes[b];
    return names[a] < names[b];
  });
  std::vector<int64_t> load(static_cast<size_t>(members), 0);
  std::vector<int> owner(bytes.size(), 0);
  for (size_t i : order) {
    const int m = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = m;
    load[static_cast<size_t>(m)] += bytes[i];
  }
  return owner;
}

namespace {

// A flat entry: a 1-D tensor whose range lies inside the global tensor.
void validate_flat(const TensorEntry& e, const std::string& name, int rank) {
  int64_t total = 1;
  for (const int64_t d : e.global_shape) {
    if (d < 0) {
      throw_error<CheckpointError>("checkpoint entry '{}' on rank {}: global shape {} is negative",
                                   name, rank, e.global_shape);
    }
    total *= d;
  }
  if (e.tensor.dim() != 1) {
    throw_error<CheckpointError>(
        "checkpoint entry '{}' on rank {}: a flat range is a 1-D tensor, got shape {}", name, rank,
        e.tensor.sizes().vec());
  }
  if (!e.offsets.empty()) {
    throw_error<CheckpointError>("checkpoint entry '{}' on rank {}: a flat range has no offsets",
                                 name, rank);
  }
  if (e.flat->numel() != e.tensor.numel()) {
    throw_error<CheckpointError>(
        "checkpoint entry '{}' on rank {}: flat range [{}, {}) has {} elements, its tensor {}",
        name, rank, e.flat->begin, e.flat->end, e.flat->numel(), e.tensor.numel());
  }
  if (e.flat->begin < 0 || e.flat->end > total) {
    throw_error<CheckpointError>(
        "checkpoint entry '{}' on rank {}: flat range [{}, {}) lies outside the {} elements of "
        "the global shape {}",
        name, rank, e.flat->begin, e.flat->end, total, e.global_shape);
  }
}

}  // namespace

// The boxes of the global tensor that entry `e` covers (a flat range: the boxes of its range).
std::vector<core::Box> entry_boxes(const TensorEntry& e) {
  if (e.flat) return core::flat_range_boxes(e.global_shape, e.flat->begin, e.flat->end);
  return {core::Box{e.offsets, e.tensor.sizes().vec()}};
}

bool boxes_meet(const core::Box& a, const core::Box& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (a.offsets[d] >= b.offsets[d] + b.lengths[d] || b.offsets[d] >= a.offsets[d] + a.lengths[d])
      return false;
  }
  return true;
}

// "box [0, 4] + [2, 4]" / "flat [3, 9)": what an entry holds, for messages and tie-breaks.
std::string entry_where(const TensorEntry& e) {
  if (e.flat) return fmt::format("flat [{}, {})", e.flat->begin, e.flat->end);
  return fmt::format("box {} + {}", e.offsets, e.tensor.sizes().vec());
}

namespace {

// Checks entry `e` (saved as `name` on `rank`: defined, storable, its box or flat range inside its
// global shape) and returns its replica set, sorted and with `rank` in it.
std::vector<int> entry_replicas(const TensorEntry& e, const std::string& name, int rank,
                                int world) {
  validate_tensor_name(name);
  if (!e.tensor.defined())
    throw_error<CheckpointError>("checkpoint entry '{}' has no tensor (undefined)", name);
  h5::storage_type(e.tensor.scalar_type(), name);  // throws for dtypes the format cannot store
  const auto sizes = e.tensor.sizes();
  if (e.flat) {
    validate_flat(e, name, rank);
  } else if (e.global_shape.size() != sizes.size() || e.offsets.size() != sizes.size()) {
    throw_error<CheckpointError>(
        "checkpoint entry '{}' on rank {}: a {}-d tensor with a {}-d global shape and {} offsets",
        name, rank, sizes.size(), e.global_shape.size(), e.offsets.size());
  }
  for (size_t d = 0; d < sizes.size() && !e.flat; ++d) {
    if (e.offsets[d] < 0 || e.offsets[d] + sizes[d] > e.global_shape[d]) {
      throw_error<CheckpointError>(
          "checkpoint entry '{}' on rank {}: box at offsets {} with shape {} lies outside the "
          "global shape {}",
          name, rank, e.offsets, sizes.vec(), e.global_shape);
    }
  }
  std::vector<int> replicas;
  switch (e.kind) {
    case TensorEntry::Kind::kReplicatedAll:
      replicas.resize(static_cast<size_t>(world));
      std::iota(replicas.begin(), replicas.end(), 0);
      break;
    case TensorEntry::Kind::kRankLocal:
      replicas = {rank};
      break;
    case TensorEntry::Kind::kExplicit:
      replicas = e.replicas.empty() ? std::vector<int>{rank} : e.replicas;
      break;
  }
  std::sort(replicas.begin(), replicas.end());
  replicas.erase(std::unique(replicas.begin(), replicas.end()), replicas.end());
  if (!std::binary_search(replicas.begin(), replicas.end(), rank)) {
    throw_error<CheckpointError>("checkpoint entry '{}': rank {} is not among its replicas {}",
                                 name, rank, replicas);
  }
  if (replicas.front() < 0 || replicas.back() >= world) {
    throw_error<CheckpointError>(
        "checkpoint entry '{}': replicas {} are not ranks of a world of {}", name, replicas, world);
  }
  return replicas;
}

// Several entries of one name must be disjoint pieces of the tensor (same global shape).
void check_pieces_disjoint(const SaveState& state,
                           const std::map<std::string, std::vector<size_t>>& by_name, int rank) {
  for (const auto& [name, idx] : by_name) {
    if (idx.size() < 2) continue;
    for (size_t a = 0; a < idx.size(); ++a) {
      const TensorEntry& ea = state.entries()[idx[a]];
      for (size_t b = a + 1; b < idx.size(); ++b) {
        const TensorEntry& eb = state.entries()[idx[b]];
        if (ea.global_shape != eb.global_shape) {
          throw_error<CheckpointError>(
              "checkpoint entry '{}' was added twice on rank {} with global shapes {} and {}", name,
              rank, ea.global_shape, eb.global_shape);
        }
        for (const auto& x : entry_boxes(ea)) {
          for (const auto& y : entry_boxes(eb)) {
            if (boxes_meet(x, y)) {
              throw_error<CheckpointError>(
                  "checkpoint entry '{}' was added twice on rank {} with overlapping pieces ({} "
                  "and "
                  "{})",
                  name, rank, entry_where(ea), entry_where(eb));
            }
          }
        }
      }
    }
  }
}

// Sorts this rank's pieces of each tensor in a deterministic order (by where they start) and
// numbers them (OwnedEntry::piece); throws when a piece's dataset name is another tensor's.
void number_pieces(std::vector<OwnedEntry>& owned) {
  auto start = [](const OwnedEntry& e) -> std::vector<int64_t> {
    if (!e.flat) return e.offsets;
    const auto boxes = core::flat_range_boxes(e.global_shape, e.flat->begin, e.flat->end);
    return boxes.empty() ? std::vector<int64_t>{} : boxes.front().offsets;
  };
  std::sort(owned.begin(), owned.end(), [&](const OwnedEntry& a, const OwnedEntry& b) {
    return a.name != b.name ? a.name < b.name : start(a) < start(b);
  });
  std::set<std::string> names_here;
  for (const auto& e : owned) names_here.insert(e.name);
  for (size_t i = 1; i < owned.size(); ++i) {
    if (owned[i].name != owned[i - 1].name) continue;
    owned[i].piece = owned[i - 1].piece + 1;
    const std::string path = piece_dataset(owned[i].name, owned[i].piece);
    PARALLAX_CHECK(!names_here.count(path), CheckpointError,
                   "checkpoint: tensor '{}' is named like piece {} of tensor '{}' in the rank file",
                   path, owned[i].piece, owned[i].name);
  }
}

}  // namespace

std::vector<OwnedEntry> select_owned(const SaveState& state, int rank, int world) {
  std::map<std::string, std::vector<size_t>> by_name;
  // Entries grouped by replica set; sets of one member are owned directly.
  std::map<std::vector<int>, std::vector<size_t>> groups;
  std::vector<OwnedEntry> owned;
  std::vector<std::string> final_names(state.entries().size());
  for (size_t i = 0; i < state.entries().size(); ++i) {
    const TensorEntry& e = state.entries()[i];
    const std::string name =
        e.kind == TensorEntry::Kind::kRankLocal ? rank_local_name(rank, e.name) : e.name;
    final_names[i] = name;
    groups[entry_replicas(e, name, rank, world)].push_back(i);
    by_name[name].push_back(i);
  }
  check_pieces_disjoint(state, by_name, rank);
  for (const auto& [members, idx] : groups) {
    const int me =
        static_cast<int>(std::lower_bound(members.begin(), members.end(), rank) - members.begin());
    std::vector<int64_t> bytes;
    std::vector<std::string> names;
    for (size_t i : idx) {
      bytes.push_back(static_cast<int64_t>(state.entries()[i].tensor.nbytes()));
      // Pieces of one tensor are told apart by where they lie (members add them in any order).
      // The key is the same on every member, whatever else of the tensor each holds outside this
      // set: name, then '\0' (below every character a name may hold, validate_tensor_name), then
      // where. Distinct names order as the names alone, as before pieces existed.
      names.push_back(final_names[i] + '\0' + entry_where(state.entries()[i]));
    }
    const std::vector<int> owner = balance_owners(bytes, names, static_cast<int>(members.size()));
    for (size_t j = 0; j < idx.size(); ++j) {
      if (owner[j] != me) continue;
      const TensorEntry& e = state.entries()[idx[j]];
      owned.push_back(OwnedEntry{final_names[idx[j]], e.tensor, e.global_shape, e.offsets, e.flat});
    }
  }
  number_pieces(owned);
  return owned;
}

}  // namespace parallax::checkpoint
