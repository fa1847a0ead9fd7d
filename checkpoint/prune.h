// Internal: rank 0's maintenance of a checkpoints directory around a save: removing what killed
// saves left behind, and pruning old checkpoints to `checkpoint.keep_last`. Both only warn on a
// failure (a directory that cannot be removed must not fail the save that was just committed).
//
// Contracts: called by rank 0 only, with no other process writing into `dir` (one job per
// checkpoints directory); `latest` is never touched here.
#pragma once

#include <cstdint>
#include <string>

namespace parallax::checkpoint {

// Removes `.tmp-*` directories and `latest.tmp-*` files of interrupted saves.
void remove_leftovers(const std::string& dir);

// Keeps the `keep_last` newest committed checkpoints counting step `step` (just committed), and
// removes the older ones; keep_last <= 0 keeps all. Each is renamed to a `.tmp-prune-*` name
// first, so that a kill during the removal leaves a temporary directory, not half a checkpoint.
void prune_checkpoints(const std::string& dir, int64_t step, int keep_last);

}  // namespace parallax::checkpoint
