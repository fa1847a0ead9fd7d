#include "data/render.h"

#include "core/error.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace parallax::data {
namespace {

using geom::Vec3;

constexpr int kTile = 16;
constexpr int kBuilding = 3;  // Prim::kind for buildings (objects use their class 0..2)

Rgb operator*(const Rgb& a, double s) {
  return {a.r * s, a.g * s, a.b * s};
}
Rgb operator+(const Rgb& a, const Rgb& b) {
  return {a.r + b.r, a.g + b.g, a.b + b.b};
}
Rgb mix(const Rgb& a, const Rgb& b, double t) {
  return a * (1 - t) + b * t;
}

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

double lattice(int64_t ix, int64_t iy, uint64_t seed) {
  const uint64_t h = mix64(seed ^ (static_cast<uint64_t>(ix) * 0x9E3779B97F4A7C15ULL) ^
                           (static_cast<uint64_t>(iy) * 0xC2B2AE3D27D4EB4FULL));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

// Smooth value noise in [0, 1) on a unit lattice.
double value_noise(double x, double y, uint64_t seed) {
  const double fx = std::floor(x), fy = std::floor(y);
  const auto ix = static_cast<int64_t>(fx), iy = static_cast<int64_t>(fy);
  double tx = x - fx, ty = y - fy;
  tx = tx * tx * (3 - 2 * tx);
  ty = ty * ty * (3 - 2 * ty);
  const double a = lattice(ix, iy, seed), b = lattice(ix + 1, iy, seed);
  const double c = lattice(ix, iy + 1, seed), d = lattice(ix + 1, iy + 1, seed);
  return (a * (1 - tx) + b * tx) * (1 - ty) + (c * (1 - tx) + d * tx) * ty;
}

double frac(double v) {
  return v - std::floor(v);
}

// An oriented box in the form the ray caster wants.
struct Prim {
  double cx, cy, cz, c, s, hl, hw, hh;
  int id;    // index into layout.objects, or -2 for a building
  int kind;  // BoxClass, or kBuilding
  Rgb color, roof;
  Vec3 o_local;  // the camera centre in the box frame
  bool inside;   // camera inside the box: never hit
};

struct Hit {
  double t = std::numeric_limits<double>::infinity();
  int prim = -1;  // -1: ground (if t finite) or sky
  int axis = 0;
  double sign = 1;
  Vec3 local;
};

void intersect(const Prim& p, const Vec3& d, Hit& best, int index) {
  if (p.inside) return;
  const Vec3 dl{p.c * d.x + p.s * d.y, -p.s * d.x + p.c * d.y, d.z};
  const double o[3] = {p.o_local.x, p.o_local.y, p.o_local.z};
  const double dd[3] = {dl.x, dl.y, dl.z};
  const double h[3] = {p.hl, p.hw, p.hh};
  double tmin = -std::numeric_limits<double>::infinity(),
         tmax = std::numeric_limits<double>::infinity();
  int axis = 0;
  double sign = 1;
  for (int a = 0; a < 3; ++a) {
    if (std::abs(dd[a]) < 1e-15) {
      if (std::abs(o[a]) > h[a]) return;
      continue;
    }
    const double inv = 1.0 / dd[a];
    double t1 = (-h[a] - o[a]) * inv, t2 = (h[a] - o[a]) * inv;
    if (t1 > t2) std::swap(t1, t2);
    if (t1 > tmin) {
      tmin = t1;
      axis = a;
      sign = dd[a] > 0 ? -1 : 1;  // entering through the face whose normal opposes the ray
    }
    tmax = std::min(tmax, t2);
    if (tmin > tmax) return;
  }
  if (tmin <= 1e-6 || tmin >= best.t) return;
  best.t = tmin;
  best.prim = index;
  best.axis = axis;
  best.sign = sign;
  best.local = {o[0] + tmin * dd[0], o[1] + tmin * dd[1], o[2] + tmin * dd[2]};
}

class CameraRenderer {
 public:
  CameraRenderer(const SceneLayout& L, int cam)
      : L_(L), cam_(L.cameras.at(static_cast<size_t>(cam))) {
    origin_ = cam_.centre();
    exposure_ = L.exposure * L.camera_exposure.at(static_cast<size_t>(cam));
    const double sz = std::max(0.0, L.sun.z);
    ground_light_ = 0.42 + 0.62 * sz;
    build_prims();
    bin_prims();
  }

  void render(int spp, uint8_t* img, int32_t* inst, float* depth) const {
    static const double kGrid[4][2] = {
        {0.375, 0.125}, {0.875, 0.375}, {0.125, 0.625}, {0.625, 0.875}};
    const int W = cam_.width, H = cam_.height;
    const int tiles_x = (W + kTile - 1) / kTile;
    for (int v = 0; v < H; ++v) {
      for (int u = 0; u < W; ++u) {
        const auto& cand = tiles_[static_cast<size_t>((v / kTile) * tiles_x + u / kTile)];
        Rgb acc;
        if (spp == 1) {
          acc = shade(trace(u + 0.5, v + 0.5, cand), u + 0.5, v + 0.5);
        } else {
          for (const auto& o : kGrid)
            acc = acc + shade(trace(u + o[0], v + o[1], cand), u + o[0], v + o[1]);
          acc = acc * 0.25;
        }
        uint8_t* px = img + (static_cast<size_t>(v) * W + u) * 3;
        const double ch[3] = {acc.r, acc.g, acc.b};
        for (int k = 0; k < 3; ++k) {
          const double x = std::round(std::clamp(ch[k] * exposure_, 0.0, 1.0) * 255.0);
          px[k] = static_cast<uint8_t>(x);
        }
        if (inst) {
          const Hit h = trace(u + 0.5, v + 0.5, cand);
          const size_t i = static_cast<size_t>(v) * W + u;
          inst[i] = h.prim >= 0 ? prims_[static_cast<size_t>(h.prim)].id : -1;
          depth[i] = std::isfinite(h.t) ? static_cast<float>(h.t) : 0.0f;
        }
      }
    }
  }

 private:
  void build_prims() {
    auto add = [&](const geom::Box& b, int id, int kind, const Rgb& color, const Rgb& roof) {
      Prim p;
      p.cx = b.x;
      p.cy = b.y;
      p.cz = b.z;
      p.c = std::cos(b.yaw);
      p.s = std::sin(b.yaw);
      p.hl = 0.5 * b.l;
      p.hw = 0.5 * b.w;
      p.hh = 0.5 * b.h;
      p.id = id;
      p.kind = kind;
      p.color = color;
      p.roof = roof;
      const Vec3 d = origin_ - Vec3{b.x, b.y, b.z};
      p.o_local = {p.c * d.x + p.s * d.y, -p.s * d.x + p.c * d.y, d.z};
      p.inside = std::abs(p.o_local.x) <= p.hl && std::abs(p.o_local.y) <= p.hw &&
                 std::abs(p.o_local.z) <= p.hh;
      prims_.push_back(p);
      boxes_.push_back(b);
    };
    for (size_t i = 0; i < L_.objects.size(); ++i) {
      const auto& o = L_.objects[i];
      add(o.box, static_cast<int>(i), o.cls, o.color, o.color);
    }
    for (const auto& b : L_.buildings) add(b.box, -2, kBuilding, b.wall, b.roof);
  }

  void bin_prims() {
    const int W = cam_.width, H = cam_.height;
    const int tiles_x = (W + kTile - 1) / kTile, tiles_y = (H + kTile - 1) / kTile;
    tiles_.assign(static_cast<size_t>(tiles_x * tiles_y), {});
    for (size_t i = 0; i < prims_.size(); ++i) {
      double umin = 1e300, umax = -1e300, vmin = 1e300, vmax = -1e300;
      int in_front = 0;
      for (const auto& c : boxes_[i].corners()) {
        double u = 0, v = 0, d = 0;
        if (cam_.project(c, u, v, d) && d > 0.05) {
          ++in_front;
          umin = std::min(umin, u);
          umax = std::max(umax, u);
          vmin = std::min(vmin, v);
          vmax = std::max(vmax, v);
        }
      }
      if (in_front == 0) continue;  // entirely behind the camera
      int tx0 = 0, tx1 = tiles_x - 1, ty0 = 0, ty1 = tiles_y - 1;
      if (in_front == 8) {  // the projection is the hull of the projected corners
        if (umax < -1 || umin > W + 1 || vmax < -1 || vmin > H + 1) continue;
        tx0 = std::clamp(static_cast<int>(std::floor((umin - 1) / kTile)), 0, tiles_x - 1);
        tx1 = std::clamp(static_cast<int>(std::floor((umax + 1) / kTile)), 0, tiles_x - 1);
        ty0 = std::clamp(static_cast<int>(std::floor((vmin - 1) / kTile)), 0, tiles_y - 1);
        ty1 = std::clamp(static_cast<int>(std::floor((vmax + 1) / kTile)), 0, tiles_y - 1);
      }
      for (int ty = ty0; ty <= ty1; ++ty) {
        for (int tx = tx0; tx <= tx1; ++tx)
          tiles_[static_cast<size_t>(ty * tiles_x + tx)].push_back(static_cast<int>(i));
      }
    }
  }

  Hit trace(double u, double v, const std::vector<int>& cand) const {
    const Vec3 d = cam_.ray_direction(u, v);
    Hit best;
    if (d.z < 0) best.t = -origin_.z / d.z;  // the ground plane z = 0
    for (int i : cand) intersect(prims_[static_cast<size_t>(i)], d, best, i);
    return best;
  }

  Rgb shade(const Hit& h, double u, double v) const {
    const Vec3 d = cam_.ray_direction(u, v);
    const double len = d.norm();
    const Vec3 dn = d * (1.0 / len);
    if (!std::isfinite(h.t)) return sky(dn);
    Rgb c;
    if (h.prim < 0) {
      const Vec3 p = origin_ + d * h.t;
      c = ground(p.x, p.y) * ground_light_;
    } else {
      c = box_color(prims_[static_cast<size_t>(h.prim)], h);
    }
    const double f = 1.0 - std::exp(-h.t * len / 260.0);
    return mix(c, L_.sky_horizon, f);
  }

  Rgb sky(const Vec3& dn) const {
    const double k = std::clamp(dn.z / 0.35, 0.0, 1.0);
    Rgb c = mix(L_.sky_horizon, L_.sky_zenith, std::sqrt(k));
    const double cs = std::max(0.0, dn.dot(L_.sun));
    const double glow = 0.5 * std::pow(cs, 200.0) + 0.12 * std::pow(cs, 8.0);
    return c + Rgb{glow, glow, glow * 0.9};
  }

  Rgb ground(double gx, double gy) const {
    const uint64_t seed = L_.texture_seed;
    const Ground kind = classify_ground(L_, gx, gy);
    // Textures in world coordinates (SceneLayout::texture_dx); adding 0 leaves a lone scene's
    // coordinates, and so its pixels, exactly as they were.
    const double x = gx + L_.texture_dx, y = gy + L_.texture_dy;
    switch (kind) {
      case Ground::kGrass: {
        const double n1 = value_noise(x * 0.12, y * 0.12, seed),
                     n2 = value_noise(x * 1.7, y * 1.7, seed + 1);
        Rgb c{0.27, 0.44, 0.19};
        c = c * (0.72 + 0.4 * n1 + 0.16 * (n2 - 0.5));
        return c + Rgb{0.06 * n1, 0.03 * n1, 0};
      }
      case Ground::kSidewalk: {
        Rgb c =
            Rgb{0.63, 0.61, 0.58} * (0.92 + 0.12 * (value_noise(x * 1.3, y * 1.3, seed + 2) - 0.5));
        for (const auto& r : L_.roads) {
          double s = 0, t = 0;
          r.local(gx, gy, s, t);
          const double e = std::abs(t) - r.half_width();
          if (s < r.s_min || s > r.s_max || e <= 0 || e > r.sidewalk) continue;
          if (e < 0.2) return Rgb{0.76, 0.75, 0.73};  // curb
          if (frac(s / 1.6) < 0.035 || frac((e - 0.2) / 1.6) < 0.035) c = c * 0.78;
          break;
        }
        return c;
      }
      case Ground::kRoad: {
        const double n1 = value_noise(x * 0.35, y * 0.35, seed + 3),
                     n2 = value_noise(x * 3.0, y * 3.0, seed + 4);
        return Rgb{0.31, 0.31, 0.33} * (0.88 + 0.2 * (n1 - 0.5) + 0.1 * (n2 - 0.5));
      }
      case Ground::kMarkingWhite:
        return Rgb{0.9, 0.9, 0.87} * (0.93 + 0.1 * (value_noise(x * 2, y * 2, seed + 5) - 0.5));
      case Ground::kMarkingYellow:
        return Rgb{0.88, 0.7, 0.2} * (0.93 + 0.1 * (value_noise(x * 2, y * 2, seed + 5) - 0.5));
    }
    return {};
  }

  Rgb box_color(const Prim& p, const Hit& h) const {
    // Face normal in the ego frame.
    Vec3 n;
    if (h.axis == 0)
      n = {h.sign * p.c, h.sign * p.s, 0};
    else if (h.axis == 1)
      n = {-h.sign * p.s, h.sign * p.c, 0};
    else
      n = {0, 0, h.sign};
    const double light = 0.42 + 0.62 * std::max(0.0, n.dot(L_.sun)) + (h.axis == 2 ? 0.05 : 0.0);
    const double zr = (h.local.z + p.hh) / (2 * p.hh);  // 0 at the bottom, 1 at the top
    const bool top = h.axis == 2 && h.sign > 0;
    Rgb c = p.color;
    switch (p.kind) {
      case kVehicle:
        if (top) {
          c = p.color * 0.9;
        } else if (h.axis == 1 && zr < 0.18 &&
                   std::abs(std::abs(h.local.x) - 0.62 * p.hl) < 0.2 * p.hl) {
          c = {0.07, 0.07, 0.07};  // wheels
        } else if (zr > 0.58 && zr < 0.92 && (h.axis == 0 || std::abs(h.local.x) < 0.8 * p.hl)) {
          c = {0.10, 0.12, 0.16};  // glass
        } else if (h.axis == 0 && zr > 0.33 && zr < 0.48 && std::abs(h.local.y) > 0.55 * p.hw) {
          c = h.sign > 0 ? Rgb{0.95, 0.92, 0.7} : Rgb{0.75, 0.06, 0.05};  // head / tail lights
        }
        break;
      case kPedestrian:
        if (zr > 0.87)
          c = {0.78, 0.6, 0.48};  // head
        else if (zr < 0.47)
          c = p.color * 0.35;  // legs
        break;
      case kCyclist:
        if (zr > 0.88)
          c = p.color * 1.1;  // helmet
        else if (zr < 0.45)
          c = {0.12, 0.12, 0.13};  // bicycle
        break;
      default: {  // building
        if (top) {
          c = p.roof;
        } else {
          const double height = h.local.z + p.hh;
          const double along = h.axis == 0 ? h.local.y : h.local.x;
          if (frac(height / 3.0) > 0.35 && frac(height / 3.0) < 0.75 &&
              frac((along + 100.0) / 2.6) > 0.3 && frac((along + 100.0) / 2.6) < 0.7 &&
              height < 2 * p.hh - 0.5) {
            c = {0.18, 0.22, 0.28};  // windows
          }
        }
      }
    }
    return c * light;
  }

  const SceneLayout& L_;
  const geom::Camera& cam_;
  Vec3 origin_;
  double exposure_ = 1, ground_light_ = 1;
  std::vector<Prim> prims_;
  std::vector<geom::Box> boxes_;
  std::vector<std::vector<int>> tiles_;
};

}  // namespace

void render_camera_into(const SceneLayout& layout, int camera, int spp, uint8_t* image,
                        int32_t* instance, float* depth) {
  if (spp != 1 && spp != 4)
    throw_error<Error>("render: samples_per_pixel must be 1 or 4, got {}", spp);
  const CameraRenderer r(layout, camera);
  r.render(spp, image, instance, depth);
}

CameraRender render_camera(const SceneLayout& layout, int camera, int spp, bool with_buffers) {
  const auto& cam = layout.cameras.at(static_cast<size_t>(camera));
  CameraRender out;
  out.image = at::empty({cam.height, cam.width, 3}, at::kByte);
  int32_t* inst = nullptr;
  float* depth = nullptr;
  if (with_buffers) {
    out.instance = at::empty({cam.height, cam.width}, at::kInt);
    out.depth = at::empty({cam.height, cam.width}, at::kFloat);
    inst = out.instance.data_ptr<int32_t>();
    depth = out.depth.data_ptr<float>();
  }
  render_camera_into(layout, camera, spp, out.image.data_ptr<uint8_t>(), inst, depth);
  return out;
}

}  // namespace parallax::data
