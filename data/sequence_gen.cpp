#include "data/sequence_gen.h"

#include "core/rng.h"
#include "data/random.h"

#include <ATen/ops/zeros.h>

#include <cmath>

namespace parallax::data {
namespace {

using geom::Box;

// The ego's footprint (make_layout's placer keeps objects 1 m clear of it).
Box ego_box(double x, double y) {
  Box b;
  b.x = x;
  b.y = y;
  b.l = 4.8;
  b.w = 2.0;
  b.h = 1.6;
  b.z = 0.8;
  return b;
}

Box moved(const Box& b, double vx, double vy, double t) {
  Box m = b;
  m.x += vx * t;
  m.y += vy * t;
  return m;
}

double to_f32(double v) {
  return static_cast<double>(static_cast<float>(v));
}

// Direction of travel along road `r` for something heading at `yaw`: the road's heading or its
// opposite, whichever is nearer.
double along(const Road& r, double yaw) {
  return r.angle + (std::cos(yaw - r.angle) >= 0 ? 0.0 : geom::kPi);
}

// Draws the speeds (stream kMotion of the sequence's seed; a fixed number of draws per road,
// lane and object, so the draws do not depend on what is placed where).
void draw_velocities(SequenceWorld& w, uint64_t seed) {
  Rng rng(core::derive_seed(seed, 0, static_cast<uint64_t>(SeedStream::kMotion)));
  const auto& roads = w.layout.roads;
  const Road& main = roads[0];
  const double ego_speed = rng.bernoulli(0.25) ? 0.0 : rng.uniform(2, 12);
  w.ego_vx = ego_speed * std::cos(main.angle);
  w.ego_vy = ego_speed * std::sin(main.angle);
  double s0 = 0, t0 = 0;
  main.local(0, 0, s0, t0);  // the ego is on a lane centre line
  const auto ego_lane = static_cast<int>(std::floor((t0 + main.half_width()) / main.lane_width));
  std::vector<std::vector<double>> lane_speed(roads.size());
  for (size_t r = 0; r < roads.size(); ++r) {
    for (int k = 0; k < roads[r].lanes; ++k) {
      const bool parked = rng.bernoulli(0.2);
      const double v = rng.uniform(3, 12);
      lane_speed[r].push_back(r == 0 && k == ego_lane ? ego_speed : (parked ? 0.0 : v));
    }
  }
  for (const Object& o : w.layout.objects) {
    const Road& r = roads[static_cast<size_t>(o.road)];
    const bool stands = rng.bernoulli(o.cls == kPedestrian ? 0.3 : 0.2);
    const double u = rng.uniform();
    double speed = 0;
    if (o.cls == kVehicle && o.lane >= 0) {
      speed = lane_speed[static_cast<size_t>(o.road)][static_cast<size_t>(o.lane)];
    } else if (o.cls == kCyclist) {
      speed = stands ? 0.0 : 2 + 4 * u;
    } else if (o.cls == kPedestrian && o.sidewalk) {
      speed = stands ? 0.0 : 0.5 + 1.3 * u;
    }
    const double heading = o.cls == kVehicle && o.lane >= 0
                               ? r.angle + (o.lane < r.forward_lanes ? 0.0 : geom::kPi)
                               : along(r, o.box.yaw);
    // Exactly 0 for what stands (no -0 from a cosine).
    w.vx.push_back(speed == 0 ? 0.0 : speed * std::cos(heading));
    w.vy.push_back(speed == 0 ? 0.0 : speed * std::sin(heading));
  }
}

// Half the clearance kept between moving things (footprints grown by it on every side): small,
// since neighbouring lanes of 3.2 m hold trucks 2.5 m wide and the ego is up to 8 degrees off its
// lane's heading.
constexpr double kGap = 0.1;

// Whether entity `e` (an object index, or objects.size() for the ego) leaves its surface or
// touches anything else at time t.
bool blocked_at(const SequenceWorld& w, size_t e, double t) {
  const auto& objs = w.layout.objects;
  const size_t n = objs.size();
  const Box ego = ego_box(w.ego_vx * t, w.ego_vy * t);
  const Box me = e == n ? ego : moved(objs[e].box, w.vx[e], w.vy[e], t);
  if (e < n && !footprint_on_surface(w.layout, me, objs[e].sidewalk)) return true;
  if (e == n && !footprint_on_surface(w.layout, me, false)) return true;
  if (e < n && me.footprint_overlaps(ego, kGap)) return true;
  for (size_t j = 0; j < n; ++j) {
    if (j == e) continue;
    if (me.footprint_overlaps(moved(objs[j].box, w.vx[j], w.vy[j], t), kGap)) return true;
  }
  for (const auto& b : w.layout.buildings) {
    if (me.footprint_overlaps(b.box, kGap)) return true;
  }
  return false;
}

// Stops whatever moving thing is blocked at some instant, until nothing moving is. Terminates:
// every pass that changes anything stops one more thing, and what stands is valid (the placer put
// it there at t = 0).
void resolve_conflicts(SequenceWorld& w, double horizon_s, double step_s) {
  const size_t n = w.layout.objects.size();
  const int steps = step_s > 0 ? static_cast<int>(std::ceil(horizon_s / step_s - 1e-9)) : 0;
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t e = 0; e <= n; ++e) {
      const bool moving =
          e == n ? (w.ego_vx != 0 || w.ego_vy != 0) : (w.vx[e] != 0 || w.vy[e] != 0);
      if (!moving) continue;
      for (int i = 0; i <= steps; ++i) {
        if (!blocked_at(w, e, std::min(horizon_s, i * step_s))) continue;
        (e == n ? w.ego_vx : w.vx[e]) = 0;
        (e == n ? w.ego_vy : w.vy[e]) = 0;
        changed = true;
        break;
      }
    }
  }
}

}  // namespace

SequenceWorld make_sequence_world(const GeneratorOptions& opts, uint64_t seed, double horizon_s) {
  SequenceWorld w;
  w.layout = make_layout(opts, seed);
  draw_velocities(w, seed);
  const double interval_s = static_cast<double>(opts.frame_interval_us) * 1e-6;
  resolve_conflicts(w, horizon_s, 0.25 * interval_s);
  return w;
}

SequenceFrame sequence_frame(const GeneratorOptions& opts, const SequenceWorld& w, double t_s) {
  SequenceFrame f;
  SceneLayout& L = f.layout;
  const SceneLayout& W = w.layout;
  // The ego's heading stays 0, so the world-to-ego map is a translation by the ego's position.
  const double ex = w.ego_vx * t_s, ey = w.ego_vy * t_s;
  L.roads = W.roads;
  for (Road& r : L.roads) {
    r.ox -= ex;
    r.oy -= ey;
  }
  L.buildings = W.buildings;
  for (Building& b : L.buildings) {
    b.box.x = to_f32(b.box.x - ex);
    b.box.y = to_f32(b.box.y - ey);
  }
  L.cameras = W.cameras;
  L.sun = W.sun;
  L.sky_zenith = W.sky_zenith;
  L.sky_horizon = W.sky_horizon;
  L.exposure = W.exposure;
  L.camera_exposure = W.camera_exposure;
  L.texture_seed = W.texture_seed;
  L.texture_dx = ex;
  L.texture_dy = ey;
  const auto& g = opts.bev;
  std::vector<float> vel;
  for (size_t k = 0; k < W.objects.size(); ++k) {
    Object o = W.objects[k];
    // World position at t, then into the ego frame, then float32 as make_layout rounds boxes.
    o.box.x = to_f32(o.box.x + w.vx[k] * t_s - ex);
    o.box.y = to_f32(o.box.y + w.vy[k] * t_s - ey);
    const double m = 0.25;  // make_layout's rule for a box inside the grid
    if (!(o.box.x >= g.x_min + m && o.box.x < g.x_max - m && o.box.y >= g.y_min + m &&
          o.box.y < g.y_max - m)) {
      continue;
    }
    L.objects.push_back(o);
    f.instance_ids.push_back(static_cast<int64_t>(k));
    vel.push_back(static_cast<float>(w.vx[k]));
    vel.push_back(static_cast<float>(w.vy[k]));
  }
  const auto K = static_cast<int64_t>(L.objects.size());
  f.velocities = at::zeros({K, 2}, at::kFloat);
  std::copy(vel.begin(), vel.end(), f.velocities.data_ptr<float>());
  // Element-wise (no LibTorch kernels on generator threads, as datagen.cpp's renders).
  f.ego_to_global = at::zeros({4, 4}, at::kDouble);
  double* T = f.ego_to_global.data_ptr<double>();
  T[0] = T[5] = T[10] = T[15] = 1;
  T[3] = ex;
  T[7] = ey;
  return f;
}

}  // namespace parallax::data
