// The DP x TP x PP layout of the world and its named groups.
//
// Rank order: TP is innermost (the tp ranks of one model replica slice are contiguous, so they sit
// on one node), then DP, then PP outermost:
//   world_rank = pp_index * (dp * tp) + dp_index * tp + tp_index
// Groups (each created once, through split, in this order on every rank; a group with the same
// ranks as an earlier one shares its communicator, see communicator_of()):
//   tp    ranks sharing (pp, dp), ordered by tp index     (tensor-parallel all-reduce/all-gather)
//   dp    ranks sharing (pp, tp), ordered by dp index     (gradient all-reduce)
//   pp    ranks sharing (dp, tp), ordered by pp index     (pipeline p2p)
// Example, world 8 = dp 2 x tp 2 x pp 2: tp groups {0,1} {2,3} {4,5} {6,7}; dp groups {0,2} {1,3}
// {4,6} {5,7}; pp groups {0,4} {1,5} {2,6} {3,7}.
// There is no dp x tp group: ranks of different tp indices hold different TP shards, so nothing is
// reduced or sharded over them together (ZeRO shards over dp within one tp index).
#pragma once

#include "comm/communicator.h"

#include <map>
#include <string>
#include <vector>

namespace parallax::comm {

// How the world's ranks are laid out over data, tensor and pipeline parallelism.
struct RankLayout {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  int world() const { return dp * tp * pp; }
  std::string to_string() const;  // "dp=2 x tp=2 x pp=1"
};

struct Coord {
  int dp = 0;
  int tp = 0;
  int pp = 0;
};

// Checks and completes a layout for `world_size` ranks. dp = 0 means world / (tp * pp).
// gpus_per_node > 0 (GPU jobs) also requires tp <= gpus_per_node and tp | gpus_per_node, so that a
// TP group never spans nodes. Throws LayoutError with the numbers in the message.
RankLayout resolve_layout(int world_size, int dp, int tp, int pp, int gpus_per_node = 0);

int rank_of(const RankLayout& layout, const Coord& coord);
Coord coord_of(const RankLayout& layout, int world_rank);
// World ranks of the `name` group ("tp", "dp", "pp", "world") that contains `world_rank`.
std::vector<int> group_ranks(const RankLayout& layout, const std::string& name, int world_rank);

// The groups of one layout over one world communicator. Construction is collective over `world`.
// Thread-safety: immutable after construction.
class Topology {
 public:
  Topology(CommPtr world, RankLayout layout);

  const RankLayout& layout() const { return layout_; }
  const Coord& coord() const { return coord_; }
  const CommPtr& world() const { return world_; }
  const CommPtr& tp() const { return group("tp"); }
  const CommPtr& dp() const { return group("dp"); }
  const CommPtr& pp() const { return group("pp"); }
  // Throws CommError naming the known groups for an unknown name.
  const CommPtr& group(const std::string& name) const;
  // The group whose communicator `name` uses: itself, or an earlier group with the same ranks
  // ("world", "tp", "dp" or "pp"), whose name then appears in that communicator's messages.
  const std::string& communicator_of(const std::string& name) const;

 private:
  CommPtr world_;
  RankLayout layout_;
  Coord coord_;
  std::map<std::string, CommPtr> groups_;
  std::map<std::string, std::string> owner_;
};

}  // namespace parallax::comm
