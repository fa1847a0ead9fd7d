// Class-balanced grouping and sampling (CBGS: Zhu et al. 2019, "Class-balanced Grouping and
// Sampling for Point Cloud 3D Object Detection"; how CenterPoint and mmdetection3d's
// CBGSDataset train nuScenes), drawn afresh every epoch and split across data-parallel ranks.
//
// The draw. A scene belongs to class c's group when it holds at least one visible box of class c
// (a scene may sit in several groups; a scene without boxes in none, and it is never drawn). With
// D the sum of the group sizes and C' the number of non-empty groups, every non-empty group gets
// floor(D / C') draws, uniformly with replacement from its scenes: each class is drawn for the
// same number of times, so a rare class's scenes come back many times an epoch and a frequent
// class's are thinned. The epoch is the concatenation, C' floor(D / C') scene slots. (mmdetection3d
// draws floor(|group| x (1/C) / (|group| / D)) per class, the same count, once at start-up; here
// each epoch draws again from (seed, epoch).)
//
// The split. A scene drawn k times goes to one rank with all k copies, so no scene is read by two
// ranks in one epoch: the distinct scenes, in a seeded order, go largest count first to the rank
// with the fewest slots so far (ties: the lowest rank). Every rank then holds floor(slots / world)
// slots: its own copies in a seeded order, cut at that length or repeated from its start up to it,
// so the ranks step through the same number of batches.
//
// Pure functions of their arguments: the same on every rank, thread and platform.
#pragma once

#include <cstdint>
#include <vector>

namespace parallax::data {

struct CbgsGroups {
  std::vector<std::vector<int64_t>> scenes;  // per class: the scenes holding it, ascending
  int64_t draws_per_class = 0;               // floor(D / C')
  int64_t epoch_slots = 0;                   // C' x draws_per_class
};

// `scene_classes[i]`: the classes of scene i's visible boxes (any order, repeats allowed; values
// outside [0, num_classes) are ignored). Throws DataError when no scene holds a box.
CbgsGroups cbgs_groups(const std::vector<std::vector<int>>& scene_classes, int num_classes);

// The epoch's draw: group 0's draws, then group 1's, ... (scene indices; repeats).
std::vector<int64_t> cbgs_draw(const CbgsGroups& g, uint64_t seed, int64_t epoch);

// Rank `rank`'s slots of the draw (the split above), `rank_slots` long. Throws DataError when the
// draw holds fewer distinct scenes than there are ranks (a rank would have nothing to read).
std::vector<int64_t> cbgs_rank_slots(const std::vector<int64_t>& draw, int rank, int world,
                                     int64_t rank_slots, uint64_t seed, int64_t epoch);

}  // namespace parallax::data
