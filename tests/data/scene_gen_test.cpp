// The generator's labels against its renderings, through the stored camera tensors only.
#include "data/datagen.h"
#include "data/render.h"
#include "test_util.h"
#include "tests/common/tolerance.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

namespace parallax::data {
namespace {

using testing::project;

struct BoxRow {
  double x, y, z, l, w, h, yaw;
  int cls;
  double vis;
};

std::vector<BoxRow> rows(const at::Tensor& boxes) {
  std::vector<BoxRow> out;
  const at::Tensor b = boxes.to(at::kDouble).contiguous();
  for (int64_t k = 0; k < b.size(0); ++k) {
    const double* r = b.data_ptr<double>() + k * 9;
    out.push_back({r[0], r[1], r[2], r[3], r[4], r[5], r[6], static_cast<int>(r[7]), r[8]});
  }
  return out;
}

// Point at local box coordinates (a, b, c) in units of half extents (-1..1).
std::vector<double> box_point(const BoxRow& b, double a, double bb, double c) {
  const double lx = a * b.l / 2, ly = bb * b.w / 2, lz = c * b.h / 2;
  return {b.x + std::cos(b.yaw) * lx - std::sin(b.yaw) * ly,
          b.y + std::sin(b.yaw) * lx + std::cos(b.yaw) * ly, b.z + lz};
}

// The stored box row is the generator's double box rounded to float (u of each value); the
// cameras are rendered from their stored float values exactly (render.h). A point of the double
// box is within box_rounding() of the float box: u (|x| + |y| + |z|) for the centre, u (l + w + h)
// for the half sizes, and the yaw's u pi turning points up to (l + w) / 2 away: 4 u of the sum.
double box_rounding(const BoxRow& b) {
  return 4 * parallax::testing::kFp32Unit *
         (std::abs(b.x) + std::abs(b.y) + std::abs(b.z) + b.l + b.w + b.h);
}

bool inside_box(const BoxRow& b, double px, double py, double pz, double tol) {
  const double dx = px - b.x, dy = py - b.y;
  const double lx = std::cos(b.yaw) * dx + std::sin(b.yaw) * dy,
               ly = -std::sin(b.yaw) * dx + std::cos(b.yaw) * dy;
  return std::abs(lx) <= b.l / 2 + tol && std::abs(ly) <= b.w / 2 + tol &&
         std::abs(pz - b.z) <= b.h / 2 + tol;
}

class SceneGenTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    GeneratorOptions o;  // the defaults: 6 cameras of 128 x 224
    for (int64_t i = 0; i < 3; ++i)
      scenes_.push_back(generate_scene(o, split_seed(11, "train"), i, true));
  }
  static void TearDownTestSuite() { scenes_.clear(); }
  static std::vector<GeneratedScene> scenes_;
};
std::vector<GeneratedScene> SceneGenTest::scenes_;

TEST_F(SceneGenTest, ProjectedPointsInsideBoxesHitTheirInstance) {
  int hits = 0, occluded = 0;
  std::vector<std::string> misses;
  for (const auto& s : scenes_) {
    const auto& r = s.record;
    const int64_t H = r.images.size(1), W = r.images.size(2);
    const auto boxes = rows(r.boxes);
    for (size_t k = 0; k < boxes.size(); ++k) {
      const auto& b = boxes[k];
      // The centre, a point low in the box and one towards its front (checks yaw and l vs w).
      std::vector<std::vector<double>> pts = {box_point(b, 0, 0, 0), box_point(b, 0, 0, -0.7),
                                              box_point(b, 0.6, 0, 0)};
      at::Tensor P = at::empty({3, 3}, at::kDouble);
      for (int i = 0; i < 3; ++i) {
        for (int j = 0; j < 3; ++j) P[i][j] = pts[static_cast<size_t>(i)][static_cast<size_t>(j)];
      }
      for (int64_t cam = 0; cam < r.images.size(0); ++cam) {
        const at::Tensor uvz = project(P, r.intrinsics[cam], r.cam_to_ego[cam]);
        for (int i = 0; i < 3; ++i) {
          const double u = uvz[i][0].item<double>(), v = uvz[i][1].item<double>(),
                       z = uvz[i][2].item<double>();
          if (z <= 0.1 || u < 1 || v < 1 || u >= W - 1 || v >= H - 1) continue;
          const int64_t pu = static_cast<int64_t>(std::floor(u)),
                        pv = static_cast<int64_t>(std::floor(v));
          const at::Tensor inst = s.instance[cam].slice(0, pv - 1, pv + 2).slice(1, pu - 1, pu + 2);
          if ((inst == static_cast<int>(k)).any().item<bool>()) {
            ++hits;
          } else if (s.depth[cam][pv][pu].item<float>() < z - 0.3) {
            ++occluded;  // something nearer covers the point
          } else {
            misses.push_back(fmt::format(
                "scene {} box {} cam {} point {}: instance {} depth {} vs {}", r.index, k, cam, i,
                s.instance[cam][pv][pu].item<int>(), s.depth[cam][pv][pu].item<float>(), z));
          }
        }
      }
    }
  }
  EXPECT_TRUE(misses.empty()) << misses.size() << " misses, first: " << misses.front();
  EXPECT_GT(hits, 60) << "too few visible points to test anything (occluded " << occluded << ")";
}

TEST_F(SceneGenTest, PixelsOfAnInstanceLieOnTheirBox) {
  // Back-project every object pixel through the stored K and cam_to_ego with its depth: the 3D
  // point must lie on the labelled box.
  int64_t checked = 0;
  for (const auto& s : scenes_) {
    const auto& r = s.record;
    const auto boxes = rows(r.boxes);
    const int64_t H = r.images.size(1), W = r.images.size(2);
    for (int64_t cam = 0; cam < r.images.size(0); ++cam) {
      const at::Tensor Kinv = at::inverse(r.intrinsics[cam].to(at::kDouble));
      const at::Tensor T = r.cam_to_ego[cam].to(at::kDouble);
      const at::Tensor inst = s.instance[cam], depth = s.depth[cam].to(at::kDouble);
      const at::Tensor idx = at::nonzero(inst >= 0);
      if (idx.size(0) == 0) continue;
      const at::Tensor v = idx.select(1, 0).to(at::kDouble) + 0.5,
                       u = idx.select(1, 1).to(at::kDouble) + 0.5;
      const at::Tensor d = depth.index({idx.select(1, 0), idx.select(1, 1)});
      const at::Tensor pix = at::stack({u, v, at::ones_like(u)}, 1);
      const at::Tensor pc = at::matmul(pix, Kinv.t()) * d.unsqueeze(1);
      const at::Tensor pe =
          at::matmul(pc, T.slice(0, 0, 3).slice(1, 0, 3).t()) + T.slice(0, 0, 3).select(1, 3);
      const at::Tensor ids = inst.index({idx.select(1, 0), idx.select(1, 1)});
      // The hit point's depth is stored as a float (u d along the pixel's ray K^-1 [u, v, 1]); the
      // double back-projection adds ~1e-15 relative.
      const at::Tensor ray = at::matmul(pix, Kinv.t()).norm(2, 1);
      for (int64_t i = 0; i < idx.size(0); i += 7) {  // a sample of the pixels keeps this fast
        const auto& b = boxes.at(static_cast<size_t>(ids[i].item<int>()));
        const double tol = box_rounding(b) + 2 * parallax::testing::kFp32Unit *
                                                 d[i].item<double>() * ray[i].item<double>();
        ASSERT_TRUE(inside_box(b, pe[i][0].item<double>(), pe[i][1].item<double>(),
                               pe[i][2].item<double>(), tol))
            << "scene " << r.index << " camera " << cam << " pixel " << u[i].item<double>() << ","
            << v[i].item<double>();
        ++checked;
      }
      (void)H;
      (void)W;
    }
  }
  EXPECT_GT(checked, 1000);
}

TEST_F(SceneGenTest, BevCellsUnderFootprintsCarryTheirClass) {
  const BevGrid g;
  for (const auto& s : scenes_) {
    const at::Tensor sem = s.record.bev_semantics.to(at::kLong);
    const auto boxes = rows(s.record.boxes);
    at::Tensor explained = at::zeros_like(sem, at::kBool);
    for (const auto& b : boxes) {
      const int64_t cls = 3 + b.cls;
      const int64_t ci = static_cast<int64_t>(std::floor((b.x - g.x_min) / g.resolution));
      const int64_t cj = static_cast<int64_t>(std::floor((b.y - g.y_min) / g.resolution));
      EXPECT_EQ(sem[ci][cj].item<int64_t>(), cls)
          << "centre cell of a box, scene " << s.record.index;
      for (int64_t i = 0; i < g.x_cells(); ++i) {
        const double x = g.x_min + (i + 0.5) * g.resolution;
        if (std::abs(x - b.x) > b.l + 1) continue;
        for (int64_t j = 0; j < g.y_cells(); ++j) {
          const double y = g.y_min + (j + 0.5) * g.resolution;
          if (std::abs(y - b.y) > b.l + 1) continue;
          // Cells inside the generator's (double) box by more than the float box's rounding.
          if (inside_box(b, x, y, b.z, -box_rounding(b))) {
            EXPECT_EQ(sem[i][j].item<int64_t>(), cls) << "cell " << i << "," << j;
          }
          // Object cells may only appear within one cell diagonal of a box of their class (a
          // geometric margin: sqrt(2) / 2 = 0.7071 cells < 0.71, plus far more than the rounding).
          if (sem[i][j].item<int64_t>() == cls && inside_box(b, x, y, b.z, 0.71))
            explained[i][j] = true;
        }
      }
    }
    EXPECT_TRUE(((sem >= 3) <= explained).all().item<bool>()) << "object cells away from every box";
    const double road = (sem == 1).to(at::kDouble).mean().item<double>();
    const double marking = (sem == 2).to(at::kDouble).mean().item<double>();
    EXPECT_GT(road, 0.05);
    EXPECT_GT(marking, 0.002);
  }
}

TEST_F(SceneGenTest, ObjectsHaveClassPriorsNoOverlapsAndStayInRange) {
  int per_class[3] = {0, 0, 0};
  for (const auto& s : scenes_) {
    const auto boxes = rows(s.record.boxes);
    for (size_t a = 0; a < boxes.size(); ++a) {
      const auto& b = boxes[a];
      ++per_class[b.cls];
      EXPECT_NEAR(b.z, b.h / 2, parallax::testing::gamma_k(2) * b.h);  // both rounded to float
      EXPECT_GE(b.x, -25);
      EXPECT_LT(b.x, 25);
      EXPECT_GE(b.y, -25);
      EXPECT_LT(b.y, 25);
      // A wrapped double yaw rounded to float: within u pi of [-pi, pi].
      EXPECT_GT(b.yaw, -M_PI * (1 + parallax::testing::kFp32Unit));
      EXPECT_LE(b.yaw, M_PI * (1 + parallax::testing::kFp32Unit));
      if (b.cls == kVehicle) {
        EXPECT_TRUE(b.l >= 3.6 && b.l <= 8.6 && b.h >= 1.3 && b.h <= 3.3) << b.l << " " << b.h;
      }
      if (b.cls == kPedestrian) {
        EXPECT_TRUE(b.l <= 0.85 && b.h >= 1.45 && b.h <= 2.0) << b.l << " " << b.h;
      }
      if (b.cls == kCyclist) {
        EXPECT_TRUE(b.l >= 1.5 && b.l <= 2.0 && b.w <= 0.75) << b.l << " " << b.w;
      }
      geom::Box ga{b.x, b.y, b.z, b.l, b.w, b.h, b.yaw};
      for (size_t c = a + 1; c < boxes.size(); ++c) {
        const auto& o = boxes[c];
        EXPECT_FALSE(ga.footprint_overlaps(geom::Box{o.x, o.y, o.z, o.l, o.w, o.h, o.yaw}, 0.0))
            << a << " vs " << c;
      }
    }
  }
  for (int c = 0; c < 3; ++c) EXPECT_GT(per_class[c], 0) << "class " << c;
}

TEST_F(SceneGenTest, VisibilityIsTheFractionOfCornersAndCentreSeen) {
  for (const auto& s : scenes_) {
    const auto& r = s.record;
    const auto boxes = rows(r.boxes);
    const int64_t H = r.images.size(1), W = r.images.size(2);
    for (size_t k = 0; k < boxes.size(); ++k) {
      const auto& b = boxes[k];
      at::Tensor P = at::empty({9, 3}, at::kDouble);
      int n = 0;
      for (double a : {-1.0, 1.0}) {
        for (double c : {-1.0, 1.0}) {
          for (double e : {-1.0, 1.0}) {
            const auto p = box_point(b, a, c, e);
            P[n][0] = p[0];
            P[n][1] = p[1];
            P[n][2] = p[2];
            ++n;
          }
        }
      }
      P[8][0] = b.x;
      P[8][1] = b.y;
      P[8][2] = b.z;
      at::Tensor seen = at::zeros({9}, at::kBool);
      for (int64_t cam = 0; cam < r.images.size(0); ++cam) {
        const at::Tensor uvz = project(P, r.intrinsics[cam], r.cam_to_ego[cam]);
        const at::Tensor u = uvz.select(1, 0), v = uvz.select(1, 1), z = uvz.select(1, 2);
        seen = seen | ((z > 0.1) & (u >= 0) & (u < W) & (v >= 0) & (v < H));
      }
      // A count of 9 points, stored as a float: within u of k / 9.
      EXPECT_NEAR(b.vis, seen.to(at::kDouble).sum().item<double>() / 9.0,
                  parallax::testing::kFp32Unit)
          << "box " << k;
    }
  }
}

TEST(SceneGenDeterminismTest, SameSeedSameSceneOtherIndexOrSeedDiffers) {
  GeneratorOptions o;
  o.cameras = 3;
  o.height = 40;
  o.width = 64;
  const auto a = generate_scene(o, 5, 3), b = generate_scene(o, 5, 3);
  EXPECT_TRUE(at::equal(a.record.images, b.record.images));
  EXPECT_TRUE(at::equal(a.record.boxes, b.record.boxes));
  EXPECT_TRUE(at::equal(a.record.cam_to_ego, b.record.cam_to_ego));
  const auto c = generate_scene(o, 5, 4), d = generate_scene(o, 6, 3);
  EXPECT_FALSE(at::equal(a.record.images, c.record.images));
  EXPECT_FALSE(at::equal(a.record.images, d.record.images));
  EXPECT_FALSE(at::equal(a.record.cam_to_ego, c.record.cam_to_ego));  // per-scene rig jitter
}

TEST(SceneGenRigTest, CamerasFollowTheDocumentedFrames) {
  GeneratorOptions o;
  const auto s = generate_scene(o, 1, 0);
  for (int64_t cam = 0; cam < o.cameras; ++cam) {
    const at::Tensor T = s.record.cam_to_ego[cam].to(at::kDouble);
    const at::Tensor R = T.slice(0, 0, 3).slice(1, 0, 3);
    // A double rotation rounded to float (entries within u |r|): R R^T within 2 u |R| |R|^T <= 6 u
    // of I, det within sum |cofactor| u |r| = 3 u of 1 (the double arithmetic: 1e-15).
    const double u = parallax::testing::kFp32Unit;
    EXPECT_TRUE(at::allclose(at::matmul(R, R.t()), at::eye(3, at::kDouble), 0, 6 * u + 1e-14));
    EXPECT_NEAR(at::det(R).item<double>(), 1.0, 3 * u + 1e-14);
    // Not rounding tolerances from here: the per-scene jitter's ranges (yaw and pitch +-1 degree,
    // roll +-0.5, position +-0.02 m, principal point +-1.5 px). Optical axis (camera +z)
    // horizontal-ish and pointing along the camera's nominal yaw.
    const double yaw = 2 * M_PI * cam / o.cameras;
    const double fx = R[0][2].item<double>(), fy = R[1][2].item<double>(),
                 fz = R[2][2].item<double>();
    EXPECT_GT(fx * std::cos(yaw) + fy * std::sin(yaw), 0.99);
    EXPECT_LT(fz, 0.0);  // pitched slightly down
    EXPECT_GT(fz, -0.08);
    // Camera +y (down in the image) points down in the ego frame.
    EXPECT_LT(R[2][1].item<double>(), -0.99);
    EXPECT_NEAR(T[2][3].item<double>(), 1.6, 0.05);
    const at::Tensor K = s.record.intrinsics[cam];
    EXPECT_NEAR(K[0][2].item<float>(), o.width / 2.0, 2.0);
    EXPECT_NEAR(K[1][2].item<float>(), o.height / 2.0, 2.0);
    EXPECT_EQ(K[2][2].item<float>(), 1.0f);  // exact
  }
}

}  // namespace
}  // namespace parallax::data
