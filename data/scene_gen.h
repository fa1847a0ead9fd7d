// Procedural driving scenes with exact labels: the layout (roads with lanes, lane markings and
// crosswalks, sidewalks, grass, buildings), the objects (vehicles, pedestrians, cyclists with
// class-specific size priors, placed on lanes and sidewalks without overlaps), the lighting and the
// per-scene jittered camera rig; then the labels of docs/data.md computed from that same geometry.
//
// Everything is a pure function of (options, split seed, scene index): the same inputs give the
// same scene on any thread. Camera parameters and box parameters are rounded to float32 before
// anything is rendered or labelled, so the stored tensors are exactly the geometry that produced
// the images.
//
// BEV label rule (exact, documented in docs/data.md): a cell carries an object's class when the
// cell's centre lies inside the object's footprint or the cell contains the object's centre;
// otherwise `marking` when any of its 4 x 4 sub-cell sample points lies on a marking, otherwise
// the ground class at the cell's centre (`road` or `background`).
#pragma once

#include "data/geometry.h"
#include "data/schema.h"

#include <cstdint>
#include <vector>

namespace parallax::data {

// The classes the generator writes, as indices into DatasetInfo's default class lists.
enum BevClass : uint8_t { kBevBackground = 0, kBevRoad = 1, kBevMarking = 2, kBevVehicle = 3 };
enum BoxClass : int { kVehicle = 0, kPedestrian = 1, kCyclist = 2, kNumBoxClasses = 3 };

struct GeneratorOptions {
  int cameras = 6;
  int height = 128;
  int width = 224;
  BevGrid bev;
  int samples_per_pixel = 4;  // 1 (pixel centre) or 4 (rotated-grid anti-aliasing)
  // Sequences (data/sequence_gen.h): scene i of a split is frame i % L of sequence i / L, frames
  // `frame_interval_us` microseconds apart. 1: every scene is an independent snapshot.
  int64_t sequence_length = 1;
  int64_t frame_interval_us = 500000;
};

struct Rgb {
  double r = 0, g = 0, b = 0;
};

struct Road {
  double ox = 0, oy = 0;  // a point on the centre line
  double angle = 0;       // heading of the forward lanes
  double lane_width = 3.5;
  int lanes = 2;          // total
  int forward_lanes = 1;  // lanes on the right (t < 0) heading along `angle`; the rest oppose
  double s_min = -1e9, s_max = 1e9;  // extent along the heading (a T-junction's side road ends)
  double sidewalk = 3;               // sidewalk width on each side
  double dash_phase = 0;
  bool crosswalks = false;

  double half_width() const { return 0.5 * lane_width * lanes; }
  // Coordinates along (s) and across (t, positive to the left) the road.
  void local(double x, double y, double& s, double& t) const;
  // The ego-frame point at (s, t).
  void point(double s, double t, double& x, double& y) const;
  // Centre offset t of lane k (0 = rightmost).
  double lane_centre(int k) const { return -half_width() + (k + 0.5) * lane_width; }
};

struct Object {
  geom::Box box;
  int cls = kVehicle;
  Rgb color;
  // Where the placer put it, so a sequence (data/sequence_gen.h) can move it along there: the
  // index of its road in SceneLayout::roads, its lane (0 = rightmost) when it stands on a lane
  // along the traffic, -1 otherwise; `sidewalk` when it stands on a sidewalk.
  int road = -1;
  int lane = -1;
  bool sidewalk = false;
};

struct Building {
  geom::Box box;
  Rgb wall, roof;
};

enum class Ground : uint8_t { kGrass, kSidewalk, kRoad, kMarkingWhite, kMarkingYellow };

struct SceneLayout {
  std::vector<Road> roads;
  std::vector<Building> buildings;
  std::vector<Object> objects;        // the labelled boxes, in label order
  std::vector<geom::Camera> cameras;  // float32-rounded
  geom::Vec3 sun;                     // unit vector towards the sun
  Rgb sky_zenith, sky_horizon;
  double exposure = 1;
  std::vector<double> camera_exposure;  // per camera
  uint64_t texture_seed = 0;
  // The ground textures are drawn at (x + texture_dx, y + texture_dy) for ego-frame point (x, y):
  // a sequence's frames set it to the ego's offset from the sequence's world origin, so the
  // asphalt and grass stay fixed to the world while the ego moves (0 for a lone scene).
  double texture_dx = 0, texture_dy = 0;
};

// The seed of scene `index` of a split whose base seed is `split_seed`.
uint64_t scene_seed(uint64_t split_seed, int64_t index);

// Builds the layout of one scene.
SceneLayout make_layout(const GeneratorOptions& opts, uint64_t seed);

// The ground at ego-frame point (x, y).
Ground classify_ground(const SceneLayout& layout, double x, double y);
// Whether the footprint of `box` (corners, centre and edge points every ~1 m) lies on a road
// (`sidewalk` false: lanes, markings, intersections) or on a sidewalk (`sidewalk` true).
bool footprint_on_surface(const SceneLayout& layout, const geom::Box& box, bool sidewalk);

// Labels (docs/data.md): bev_semantics uint8 [X, Y] and boxes float32 [K, 9] (visibility from the
// layout's cameras).
at::Tensor bev_labels(const SceneLayout& layout, const BevGrid& bev);
at::Tensor box_labels(const SceneLayout& layout);
// Fraction of the 8 corners and the centre of `box` visible in at least one camera.
double box_visibility(const geom::Box& box, const std::vector<geom::Camera>& cameras);

}  // namespace parallax::data
