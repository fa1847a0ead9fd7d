// What one rank contributes to a checkpoint: "state entries".
//
// A tensor entry is (name, local tensor, global shape, offsets, replicas): this rank holds the box
// [offsets, offsets + tensor.sizes()) of the global tensor `name`, and `replicas` (world ranks,
// this rank included) hold identical copies of that same box. A flat entry holds elements
// [begin, begin + tensor.numel()) of the C-order flattening of the global tensor instead, as a
// 1-D tensor. Examples:
//   - DDP parameter, replicated on every dp rank:   add_replicated("model/w", w, dp_ranks)
//   - ZeRO rank's piece of a parameter's moment:      add_flat_shard("optim/fc.weight.exp_avg", m,
//                                                                   {37, 13}, begin)
//   - Megatron TP column split, replicated over dp:  add_shard("model/fc.weight", w_i, {O, I},
//                                                              {i * O / tp, 0}, dp_ranks_of_my_tp)
//   - PP: each stage adds only the layers it owns (disjoint names), replicated over its dp group.
//   - per-rank state (RNG, sampler):                 add_rank_local("rng/cpu", t)  ->
//   "rank/<r>/rng/cpu"
// Exactly one member of each replica set writes a box ("owner"): the members balance the entries
// replicated over the same set by size (largest first, to the least-loaded member), so all ranks
// write in parallel and nothing is written twice. Contract: every member of a replica set adds the
// same entries for that set (same names, boxes and dtypes; order free). A violation is caught at
// commit time (a tensor whose shards do not tile it exactly) and fails the save, naming the tensor.
// A rank may add several entries of one name when their boxes (or flat ranges) are disjoint: a
// tensor-parallel rank's pieces of a fused weight, a ZeRO rank's range of a split tensor.
//
// Small scalars (step counters, loss scale, sampler position) go to `extra`, stored in
// metadata.json. Rank 0's extra is the one that is saved: keep global values identical on all
// ranks.
//
// A SaveState holds references to the tensors (no copy); Checkpointer::save consumes it. Not
// thread-safe.
#pragma once

#include "checkpoint/format.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace parallax::checkpoint {

struct TensorEntry {
  std::string name;
  at::Tensor tensor;                  // this rank's box (any device, any stored dtype)
  std::vector<int64_t> global_shape;  // shape of the whole tensor
  std::vector<int64_t> offsets;       // where the box starts in it (empty for a flat entry)
  std::optional<FlatRange> flat;      // set: `tensor` is 1-D and holds this range of the tensor
  std::vector<int> replicas;  // world ranks holding an identical box; empty = resolved at save
  enum class Kind { kReplicatedAll, kExplicit, kRankLocal } kind = Kind::kExplicit;
};

class SaveState {
 public:
  // The whole tensor, replicated on `replicas` (world ranks; empty: every rank of the world).
  void add_replicated(const std::string& name, const at::Tensor& tensor,
                      std::vector<int> replicas = {});
  // A box of a larger tensor. `replicas` empty: only this rank holds this box.
  void add_shard(const std::string& name, const at::Tensor& tensor,
                 std::vector<int64_t> global_shape, std::vector<int64_t> offsets,
                 std::vector<int> replicas = {});
  // Elements [begin, begin + tensor.numel()) of the C-order flattening of a tensor of
  // `global_shape`; `tensor` is 1-D. `replicas` empty: only this rank holds this range.
  void add_flat_shard(const std::string& name, const at::Tensor& tensor,
                      std::vector<int64_t> global_shape, int64_t begin,
                      std::vector<int> replicas = {});
  // State of this rank alone, stored as rank_local_name(rank, name).
  void add_rank_local(const std::string& name, const at::Tensor& tensor);

  // Scalars for metadata.json's "extra". Throws CheckpointError for a non-finite double.
  void set_extra(const std::string& key, int64_t value);
  void set_extra(const std::string& key, int value) { set_extra(key, static_cast<int64_t>(value)); }
  void set_extra(const std::string& key, double value);
  void set_extra(const std::string& key, const std::string& value);
  void set_extra(const std::string& key, const char* value) { set_extra(key, std::string(value)); }

  const std::vector<TensorEntry>& entries() const { return entries_; }
  std::vector<TensorEntry>& entries() { return entries_; }
  const std::map<std::string, ExtraValue>& extra() const { return extra_; }
  int64_t nbytes() const;  // bytes of every entry this rank holds (before ownership)

 private:
  std::vector<TensorEntry> entries_;
  std::map<std::string, ExtraValue> extra_;
};

// An entry this rank writes, after ownership is decided.
struct OwnedEntry {
  std::string name;  // final name (rank-local names prefixed)
  at::Tensor tensor;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;   // a box's (empty when flat)
  std::optional<FlatRange> flat;  // a flat range's
  int piece = 0;  // this rank's k-th piece of the tensor (format.h: dataset piece_dataset(name, k))
};

// Resolves names and replica sets for world rank `rank` of `world`, validates every entry (name,
// box or flat range inside the global shape, a flat entry's tensor 1-D, storable dtype, this rank
// among the replicas; entries of one name only as disjoint pieces of one global shape) and keeps
// the entries this rank owns, sorted by name, then by their first element, numbered as pieces of
// the rank file (0, 1, ... per name). Throws CheckpointError naming the entry (for overlapping
// pieces, both).
std::vector<OwnedEntry> select_owned(const SaveState& state, int rank, int world);

// The size-balanced assignment used for one replica set of `members` ranks: entry i (of
// `bytes[i]`, tie-broken by `names[i]`) goes to the member index returned at position i. Largest
// first, each to the member with the fewest bytes so far (lowest index on ties). Deterministic.
std::vector<int> balance_owners(const std::vector<int64_t>& bytes,
                                const std::vector<std::string>& names, int members);

}  // namespace parallax::checkpoint
