#include "data/scene_gen.h"

#include "core/rng.h"
#include "data/random.h"

#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>

namespace parallax::data {
namespace {

using geom::Box;
using geom::kPi;

using geom::kDeg;

Rgb hsv(double h_deg, double s, double v) {
  h_deg = std::fmod(h_deg, 360.0);
  if (h_deg < 0) h_deg += 360.0;
  const double c = v * s, hp = h_deg / 60.0, x = c * (1 - std::abs(std::fmod(hp, 2.0) - 1));
  double r = 0, g = 0, b = 0;
  if (hp < 1)
    r = c, g = x;
  else if (hp < 2)
    r = x, g = c;
  else if (hp < 3)
    g = c, b = x;
  else if (hp < 4)
    g = x, b = c;
  else if (hp < 5)
    r = x, b = c;
  else
    r = c, b = x;
  const double m = v - c;
  return {r + m, g + m, b + m};
}

double f32(double v) {
  return static_cast<double>(static_cast<float>(v));
}

Box round_box(Box b) {
  b.x = f32(b.x);
  b.y = f32(b.y);
  b.z = f32(b.z);
  b.l = f32(b.l);
  b.w = f32(b.w);
  b.h = f32(b.h);
  b.yaw = f32(b.yaw);
  return b;
}

bool is_road(Ground g) {
  return g == Ground::kRoad || g == Ground::kMarkingWhite || g == Ground::kMarkingYellow;
}

// Footprint corners, the centre and edge points every ~1 m all satisfy `pred`.
template <class Pred>
bool footprint_all(const Box& b, double step, Pred pred) {
  const int nl = std::max(1, static_cast<int>(std::ceil(b.l / step)));
  const int nw = std::max(1, static_cast<int>(std::ceil(b.w / step)));
  const double c = std::cos(b.yaw), s = std::sin(b.yaw);
  for (int i = 0; i <= nl; ++i) {
    for (int j = 0; j <= nw; ++j) {
      const double lx = (static_cast<double>(i) / nl - 0.5) * b.l,
                   ly = (static_cast<double>(j) / nw - 0.5) * b.w;
      if (!pred(b.x + c * lx - s * ly, b.y + s * lx + c * ly)) return false;
    }
  }
  return true;
}

struct Placer {
  const GeneratorOptions& opts;
  SceneLayout& layout;
  Rng& rng;
  Box ego;

  bool in_bev(const Box& b) const {
    const auto& g = opts.bev;
    const double m = 0.25;
    return b.x >= g.x_min + m && b.x < g.x_max - m && b.y >= g.y_min + m && b.y < g.y_max - m;
  }
  bool free(const Box& b, double margin) const {
    if (b.footprint_overlaps(ego, 1.0)) return false;
    for (const auto& o : layout.objects) {
      if (b.footprint_overlaps(o.box, margin)) return false;
    }
    for (const auto& o : layout.buildings) {
      if (b.footprint_overlaps(o.box, margin)) return false;
    }
    return true;
  }
  const Road& pick_road() { return layout.roads[rng.below(layout.roads.size())]; }

  void size_for(int cls, Box& b) {
    if (cls == kVehicle) {
      if (rng.bernoulli(0.8)) {  // cars
        b.l = rng.normal_clamped(4.5, 0.35, 3.7, 5.3);
        b.w = rng.normal_clamped(1.85, 0.1, 1.6, 2.1);
        b.h = rng.normal_clamped(1.55, 0.12, 1.35, 1.9);
      } else {  // vans and trucks
        b.l = rng.uniform(5.5, 8.5);
        b.w = rng.uniform(2.1, 2.5);
        b.h = rng.uniform(2.2, 3.2);
      }
    } else if (cls == kPedestrian) {
      b.l = rng.uniform(0.5, 0.8);
      b.w = rng.uniform(0.5, 0.75);
      b.h = rng.normal_clamped(1.72, 0.09, 1.5, 1.95);
    } else {
      b.l = rng.uniform(1.6, 1.9);
      b.w = rng.uniform(0.5, 0.7);
      b.h = rng.uniform(1.5, 1.85);
    }
    b.z = 0.5 * b.h;
  }

  Rgb color_for(int cls) {
    // Class-specific colour families with per-object variation.
    if (cls == kVehicle)
      return hsv(rng.uniform(-12, 18), rng.uniform(0.55, 0.9), rng.uniform(0.45, 0.9));
    if (cls == kPedestrian)
      return hsv(rng.uniform(275, 320), rng.uniform(0.45, 0.8), rng.uniform(0.5, 0.9));
    return hsv(rng.uniform(42, 62), rng.uniform(0.6, 0.95), rng.uniform(0.6, 0.95));
  }

  // One placement attempt for class `cls`; true when placed.
  bool try_place(int cls) {
    Box b;
    size_for(cls, b);
    const Road& r = pick_road();
    const int road = static_cast<int>(&r - layout.roads.data());
    int lane = -1;
    const double hw = r.half_width();
    const double s = rng.uniform(-45, 45);
    double t = 0, yaw = r.angle;
    enum class Surface { kRoad, kSidewalk } surface = Surface::kRoad;
    if (cls == kVehicle) {
      const int k = static_cast<int>(rng.below(static_cast<uint64_t>(r.lanes)));
      t = r.lane_centre(k) + rng.normal(0, 0.15);
      lane = k;
      yaw = r.angle + (k < r.forward_lanes ? 0.0 : kPi) + rng.normal(0, 0.03);
    } else if (cls == kPedestrian) {
      if (rng.bernoulli(0.75)) {
        surface = Surface::kSidewalk;
        t = (rng.bernoulli(0.5) ? 1 : -1) * (hw + rng.uniform(0.45, r.sidewalk - 0.45));
        yaw = rng.uniform(-kPi, kPi);
      } else {
        t = rng.uniform(-hw + 0.5, hw - 0.5);
        yaw = r.angle + (rng.bernoulli(0.5) ? 0.5 : -0.5) * kPi + rng.normal(0, 0.2);
      }
    } else {
      if (rng.bernoulli(0.7)) {
        const bool fwd = rng.bernoulli(0.5);
        t = (fwd ? -1 : 1) * (hw - 0.9) + rng.normal(0, 0.15);
        lane = fwd ? 0 : r.lanes - 1;
        yaw = r.angle + (fwd ? 0.0 : kPi) + rng.normal(0, 0.05);
      } else {
        surface = Surface::kSidewalk;
        t = (rng.bernoulli(0.5) ? 1 : -1) * (hw + rng.uniform(0.5, r.sidewalk - 0.5));
        yaw = r.angle + (rng.bernoulli(0.5) ? 0.0 : kPi) + rng.normal(0, 0.1);
      }
    }
    r.point(s, t, b.x, b.y);
    b.yaw = geom::wrap_angle(yaw);
    b = round_box(b);
    if (!in_bev(b) || !free(b, 0.4)) return false;
    if (!footprint_on_surface(layout, b, surface == Surface::kSidewalk)) return false;
    layout.objects.push_back({b, cls, color_for(cls), road, lane, surface == Surface::kSidewalk});
    return true;
  }

  bool try_building() {
    const Road& r = pick_road();
    const double hw = r.half_width();
    Box b;
    b.l = rng.uniform(8, 20);
    b.w = rng.uniform(8, 16);
    b.h = rng.uniform(4, 16);
    b.z = 0.5 * b.h;
    const double side = rng.bernoulli(0.5) ? 1 : -1;
    const double t = side * (hw + r.sidewalk + rng.uniform(3.0, 14.0) + 0.5 * b.w);
    r.point(rng.uniform(-60, 60), t, b.x, b.y);
    b.yaw = geom::wrap_angle(r.angle);
    b = round_box(b);
    if (!free(b, 1.5)) return false;
    const bool on_grass = footprint_all(b, 1.0, [&](double x, double y) {
      // Keep a 1 m gap to any road or sidewalk.
      for (double dx : {-1.0, 0.0, 1.0}) {
        for (double dy : {-1.0, 0.0, 1.0}) {
          if (classify_ground(layout, x + dx, y + dy) != Ground::kGrass) return false;
        }
      }
      return true;
    });
    if (!on_grass) return false;
    const double hue = rng.uniform(15, 45);
    layout.buildings.push_back({b, hsv(hue, rng.uniform(0.05, 0.3), rng.uniform(0.45, 0.8)),
                                hsv(hue, 0.1, rng.uniform(0.3, 0.5))});
    return true;
  }
};

}  // namespace

void Road::local(double x, double y, double& s, double& t) const {
  const double c = std::cos(angle), sn = std::sin(angle);
  const double dx = x - ox, dy = y - oy;
  s = c * dx + sn * dy;
  t = -sn * dx + c * dy;
}

void Road::point(double s, double t, double& x, double& y) const {
  const double c = std::cos(angle), sn = std::sin(angle);
  x = ox + c * s - sn * t;
  y = oy + sn * s + c * t;
}

bool footprint_on_surface(const SceneLayout& layout, const Box& box, bool sidewalk) {
  return footprint_all(box, 1.0, [&](double x, double y) {
    const Ground g = classify_ground(layout, x, y);
    return sidewalk ? g == Ground::kSidewalk : is_road(g);
  });
}

uint64_t scene_seed(uint64_t split_seed, int64_t index) {
  return core::derive_seed(split_seed, static_cast<uint64_t>(index),
                           static_cast<uint64_t>(SeedStream::kScene));
}

Ground classify_ground(const SceneLayout& layout, double x, double y) {
  int on = -1, count = 0;
  bool sidewalk = false;
  for (size_t i = 0; i < layout.roads.size(); ++i) {
    const Road& r = layout.roads[i];
    double s = 0, t = 0;
    r.local(x, y, s, t);
    const double hw = r.half_width();
    if (s < r.s_min || s > r.s_max) continue;
    const double at = std::abs(t);
    if (at <= hw) {
      on = static_cast<int>(i);
      ++count;
    } else if (at <= hw + r.sidewalk) {
      sidewalk = true;
    }
  }
  if (count == 0) return sidewalk ? Ground::kSidewalk : Ground::kGrass;
  if (count > 1) return Ground::kRoad;  // intersection interior: no markings
  const Road& r = layout.roads[static_cast<size_t>(on)];
  double s = 0, t = 0;
  r.local(x, y, s, t);
  const double hw = r.half_width();
  // Edge lines (solid white, 0.2 m, 0.3 m in from the edge).
  if (std::abs(std::abs(t) - (hw - 0.3)) <= 0.1) return Ground::kMarkingWhite;
  // Centre divider between the two directions (solid yellow, 0.2 m).
  if (r.forward_lanes > 0 && r.forward_lanes < r.lanes &&
      std::abs(t - (-hw + r.forward_lanes * r.lane_width)) <= 0.1) {
    return Ground::kMarkingYellow;
  }
  // Lane lines within a direction (dashed white, 0.15 m, 3 m dashes every 9 m).
  for (int k = 1; k < r.lanes; ++k) {
    if (k == r.forward_lanes) continue;
    if (std::abs(t - (-hw + k * r.lane_width)) <= 0.075) {
      double ph = std::fmod(s - r.dash_phase, 9.0);
      if (ph < 0) ph += 9.0;
      if (ph < 3.0) return Ground::kMarkingWhite;
    }
  }
  // Crosswalks: 3 m wide zebra bands just outside each crossing road.
  if (r.crosswalks) {
    for (size_t i = 0; i < layout.roads.size(); ++i) {
      if (static_cast<int>(i) == on) continue;
      const Road& q = layout.roads[i];
      double sq = 0, tq = 0;
      q.local(x, y, sq, tq);
      const double d = std::abs(tq) - q.half_width();
      if (d >= 0.6 && d <= 3.6 && std::abs(t) <= hw - 0.5) {
        double ph = std::fmod(t + hw, 1.0);
        if (ph < 0) ph += 1.0;
        if (ph < 0.5) return Ground::kMarkingWhite;
      }
    }
  }
  return Ground::kRoad;
}

SceneLayout make_layout(const GeneratorOptions& opts, uint64_t seed) {
  Rng rng(seed);
  SceneLayout L;

  // Roads: the ego drives in a right-hand lane of the main road; optionally a crossing road
  // (four-way) or a side road (T-junction).
  Road main;
  const double lane_pick = rng.uniform();
  main.lanes = lane_pick < 0.4 ? 2 : (lane_pick < 0.7 ? 3 : 4);
  main.forward_lanes = (main.lanes + 1) / 2;
  main.lane_width = rng.uniform(3.2, 3.8);
  main.sidewalk = rng.uniform(2.0, 4.0);
  main.angle = rng.uniform(-8, 8) * kDeg;
  main.dash_phase = rng.uniform(0, 9);
  const int ego_lane = static_cast<int>(rng.below(static_cast<uint64_t>(main.forward_lanes)));
  const double te = main.lane_centre(ego_lane);
  main.ox = std::sin(main.angle) * te;  // so that the origin has t = te, s = 0
  main.oy = -std::cos(main.angle) * te;
  const double kind = rng.uniform();
  if (kind >= 0.45) {
    Road cross;
    cross.lanes = rng.bernoulli(0.6) ? 2 : 4;
    cross.forward_lanes = cross.lanes / 2;
    cross.lane_width = rng.uniform(3.2, 3.8);
    cross.sidewalk = rng.uniform(2.0, 4.0);
    cross.angle = main.angle + 90 * kDeg + rng.uniform(-12, 12) * kDeg;
    cross.dash_phase = rng.uniform(0, 9);
    main.point(rng.uniform(-22, 22), 0.0, cross.ox, cross.oy);
    if (kind >= 0.8) {  // T-junction: the side road starts at the main road's centre line
      if (rng.bernoulli(0.5))
        cross.s_min = 0;
      else
        cross.s_max = 0;
    }
    const bool zebra = rng.bernoulli(0.7);
    main.crosswalks = cross.crosswalks = zebra;
    L.roads = {main, cross};
  } else {
    L.roads = {main};
  }

  // Camera rig with per-scene jitter of extrinsics and intrinsics.
  for (const auto& nominal : geom::nominal_rig(opts.cameras)) {
    geom::RigParams p = nominal;
    p.yaw += rng.uniform(-1, 1) * kDeg;
    p.pitch += rng.uniform(-1, 1) * kDeg;
    p.roll += rng.uniform(-0.5, 0.5) * kDeg;
    p.position = p.position + geom::Vec3{rng.uniform(-0.02, 0.02), rng.uniform(-0.02, 0.02),
                                         rng.uniform(-0.02, 0.02)};
    const double fs = rng.uniform(0.98, 1.02), dcx = rng.uniform(-1.5, 1.5),
                 dcy = rng.uniform(-1.5, 1.5);
    L.cameras.push_back(
        geom::round_to_float(geom::make_camera(p, opts.height, opts.width, fs, dcx, dcy)));
  }

  // Lighting.
  const double az = rng.uniform(-kPi, kPi), el = rng.uniform(25, 65) * kDeg;
  L.sun = {std::cos(el) * std::cos(az), std::cos(el) * std::sin(az), std::sin(el)};
  L.sky_zenith = hsv(rng.uniform(205, 222), rng.uniform(0.45, 0.65), rng.uniform(0.75, 0.9));
  L.sky_horizon = hsv(rng.uniform(200, 215), rng.uniform(0.08, 0.2), rng.uniform(0.85, 0.95));
  L.exposure = rng.uniform(0.85, 1.15);
  for (int k = 0; k < opts.cameras; ++k) L.camera_exposure.push_back(rng.uniform(0.95, 1.05));
  L.texture_seed = rng.next_u64();

  // Buildings first (off the roads), then objects on lanes and sidewalks.
  Box ego;
  ego.l = 4.8;
  ego.w = 2.0;
  ego.h = 1.6;
  ego.z = 0.8;
  Placer placer{opts, L, rng, ego};
  const int n_buildings = static_cast<int>(rng.range(4, 10));
  for (int i = 0; i < n_buildings; ++i) {
    for (int attempt = 0; attempt < 20 && !placer.try_building(); ++attempt) {
    }
  }
  const int counts[kNumBoxClasses] = {static_cast<int>(rng.range(3, 12)),
                                      static_cast<int>(rng.range(2, 10)),
                                      static_cast<int>(rng.range(1, 5))};
  for (int cls = 0; cls < kNumBoxClasses; ++cls) {
    for (int i = 0; i < counts[cls]; ++i) {
      for (int attempt = 0; attempt < 40 && !placer.try_place(cls); ++attempt) {
      }
    }
  }
  return L;
}

at::Tensor bev_labels(const SceneLayout& layout, const BevGrid& g) {
  const int64_t X = g.x_cells(), Y = g.y_cells();
  at::Tensor out = at::zeros({X, Y}, at::kByte);
  uint8_t* p = out.data_ptr<uint8_t>();
  const double res = g.resolution;
  for (int64_t i = 0; i < X; ++i) {
    for (int64_t j = 0; j < Y; ++j) {
      const double x0 = g.x_min + i * res, y0 = g.y_min + j * res;
      bool marking = false;
      for (int a = 0; a < 4 && !marking; ++a) {
        for (int b = 0; b < 4 && !marking; ++b) {
          const Ground gr =
              classify_ground(layout, x0 + (a + 0.5) * 0.25 * res, y0 + (b + 0.5) * 0.25 * res);
          marking = gr == Ground::kMarkingWhite || gr == Ground::kMarkingYellow;
        }
      }
      uint8_t cls = kBevBackground;
      if (marking) {
        cls = kBevMarking;
      } else if (classify_ground(layout, x0 + 0.5 * res, y0 + 0.5 * res) == Ground::kRoad) {
        cls = kBevRoad;
      }
      p[i * Y + j] = cls;
    }
  }
  // Objects over ground classes: cells whose centre is inside a footprint, plus the centre cell.
  for (const auto& o : layout.objects) {
    const uint8_t cls = static_cast<uint8_t>(kBevVehicle + o.cls);
    const double r = 0.5 * std::hypot(o.box.l, o.box.w);
    const int64_t i0 =
        std::max<int64_t>(0, static_cast<int64_t>(std::floor((o.box.x - r - g.x_min) / res)));
    const int64_t i1 =
        std::min<int64_t>(X - 1, static_cast<int64_t>(std::floor((o.box.x + r - g.x_min) / res)));
    const int64_t j0 =
        std::max<int64_t>(0, static_cast<int64_t>(std::floor((o.box.y - r - g.y_min) / res)));
    const int64_t j1 =
        std::min<int64_t>(Y - 1, static_cast<int64_t>(std::floor((o.box.y + r - g.y_min) / res)));
    for (int64_t i = i0; i <= i1; ++i) {
      for (int64_t j = j0; j <= j1; ++j) {
        if (o.box.footprint_contains(g.x_min + (i + 0.5) * res, g.y_min + (j + 0.5) * res))
          p[i * Y + j] = cls;
      }
    }
  }
  for (const auto& o : layout.objects) {
    const auto i = static_cast<int64_t>(std::floor((o.box.x - g.x_min) / res));
    const auto j = static_cast<int64_t>(std::floor((o.box.y - g.y_min) / res));
    if (i >= 0 && i < X && j >= 0 && j < Y && p[i * Y + j] < kBevVehicle) {
      p[i * Y + j] = static_cast<uint8_t>(kBevVehicle + o.cls);
    }
  }
  return out;
}

double box_visibility(const geom::Box& box, const std::vector<geom::Camera>& cameras) {
  auto pts = box.corners();
  int visible = 0;
  auto seen = [&](const geom::Vec3& p) {
    for (const auto& c : cameras) {
      if (c.sees(p)) return true;
    }
    return false;
  };
  for (const auto& p : pts) visible += seen(p) ? 1 : 0;
  visible += seen(box.centre()) ? 1 : 0;
  return visible / 9.0;
}

at::Tensor box_labels(const SceneLayout& layout) {
  const auto K = static_cast<int64_t>(layout.objects.size());
  at::Tensor out = at::zeros({K, kBoxColumns}, at::kFloat);
  float* p = out.data_ptr<float>();
  for (int64_t k = 0; k < K; ++k) {
    const auto& o = layout.objects[static_cast<size_t>(k)];
    float* row = p + k * kBoxColumns;
    row[kBoxX] = static_cast<float>(o.box.x);
    row[kBoxY] = static_cast<float>(o.box.y);
    row[kBoxZ] = static_cast<float>(o.box.z);
    row[kBoxL] = static_cast<float>(o.box.l);
    row[kBoxW] = static_cast<float>(o.box.w);
    row[kBoxH] = static_cast<float>(o.box.h);
    row[kBoxYaw] = static_cast<float>(o.box.yaw);
    row[kBoxClass] = static_cast<float>(o.cls);
    row[kBoxVisibility] = static_cast<float>(box_visibility(o.box, layout.cameras));
  }
  return out;
}

}  // namespace parallax::data
