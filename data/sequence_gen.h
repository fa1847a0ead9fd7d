// Synthetic driving sequences (docs/data.md, "Sequences"): one world seen at several instants.
//
// A sequence's world is the layout of the sequence's seed (make_layout: the world frame is frame
// 0's ego frame, so frame 0 is exactly the lone scene of that seed) plus constant ground
// velocities drawn from a stream of their own: the ego along its lane, vehicles along their lane
// (one speed per lane, so a lane's vehicles keep their gaps; the ego's lane moves with the ego),
// cyclists along their lane or sidewalk, pedestrians along their sidewalk; pedestrians crossing a
// road stand. The ego keeps its initial heading (no yaw rate): it moves along its lane, which is
// at most 8 degrees off that heading. Then every moving thing whose footprint, at any of 4
// instants per frame interval over the sequence, leaves its surface (road or sidewalk) or
// touches another object, a building or the ego, is stopped, until nothing moving does: what
// moves never overlaps anything, and stationary things have velocity exactly 0.
//
// A frame is the world moved to time t and carried into that instant's ego frame, with the boxes
// rounded to float32 as make_layout rounds them; it keeps the objects whose centre lies inside
// the BEV grid (the placer's rule), so the renderer and the label functions of scene_gen.h see a
// layout like any other. Everything is a pure function of its inputs (thread-safe).
#pragma once

#include "data/scene_gen.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace parallax::data {

struct SequenceWorld {
  SceneLayout layout;          // frame 0; the world frame is frame 0's ego frame
  std::vector<double> vx, vy;  // per object of layout.objects: world velocity in m/s
  double ego_vx = 0, ego_vy = 0;
};

// The world of a sequence of layout seed `seed`, resolved over `horizon_s` seconds (the last
// frame's time of a full sequence, so every frame of a sequence sees the same velocities).
SequenceWorld make_sequence_world(const GeneratorOptions& opts, uint64_t seed, double horizon_s);

struct SequenceFrame {
  SceneLayout layout;                 // in the ego frame at time t
  std::vector<int64_t> instance_ids;  // per layout object: its index in the world's objects
  at::Tensor velocities;              // float32 [K, 2]: ground velocity in the ego frame at t
  at::Tensor ego_to_global;           // float64 [4, 4]: the ego pose at t in the world frame
};

// What the ego sees at time `t_s` seconds after frame 0.
SequenceFrame sequence_frame(const GeneratorOptions& opts, const SequenceWorld& world, double t_s);

}  // namespace parallax::data
