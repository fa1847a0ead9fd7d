// Temporal fusion (models/temporal.h): the alignment of a previous BEV to the current ego frame
// against a hand-written bilinear reference and with a static world point, and the temporal bev
// model's units, costs, gradients and batch checks.
#include "models/temporal.h"
#include "core/error.h"
#include "models/model.h"
#include "models/perception_model.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

namespace parallax::models {
namespace {

at::Tensor pose2d(double yaw, double tx, double ty) {
  at::Tensor p = at::eye(4, at::kDouble);
  p[0][0] = std::cos(yaw);
  p[0][1] = -std::sin(yaw);
  p[1][0] = std::sin(yaw);
  p[1][1] = std::cos(yaw);
  p[0][3] = tx;
  p[1][3] = ty;
  return p;
}

// Bilinear sample of map [C, nx, ny] at metric (x, y) on `g`, zero outside (the reference).
std::vector<double> sample(const at::Tensor& map, const BevGrid& g, double x, double y) {
  const double fi = (x - g.x_min) / g.resolution - 0.5, fj = (y - g.y_min) / g.resolution - 0.5;
  const auto i0 = static_cast<int64_t>(std::floor(fi)), j0 = static_cast<int64_t>(std::floor(fj));
  const double a = fi - static_cast<double>(i0), b = fj - static_cast<double>(j0);
  std::vector<double> out(static_cast<size_t>(map.size(0)), 0.0);
  const auto acc = map.accessor<double, 3>();
  for (int di = 0; di < 2; ++di) {
    for (int dj = 0; dj < 2; ++dj) {
      const int64_t i = i0 + di, j = j0 + dj;
      if (i < 0 || i >= g.nx || j < 0 || j >= g.ny) continue;
      const double w = (di ? a : 1 - a) * (dj ? b : 1 - b);
      for (int64_t c = 0; c < map.size(0); ++c) out[static_cast<size_t>(c)] += w * acc[c][i][j];
    }
  }
  return out;
}

TEST(AlignBevTest, MatchesABilinearReferenceAndCopiesForIdentityAndWholeCells) {
  at::manual_seed(1);
  const BevGrid g{-8, -6, 0.5, 32, 24};
  const at::Tensor prev = at::randn({3, 2, g.nx, g.ny}, at::kDouble);
  const at::Tensor poses =
      at::stack({pose2d(0, 0, 0), pose2d(0, -1.5, 1.0), pose2d(0.3, -2.2, 0.7)}).to(at::kFloat);
  const at::Tensor got = align_bev(prev.to(at::kFloat), poses, g).to(at::kDouble);
  const at::Tensor p32 = prev.to(at::kFloat).to(at::kDouble);
  // Identity and whole-cell moves put every sampling point on a previous cell centre, up to the
  // float32 arithmetic of the normalised coordinates and grid_sample's unnormalisation (a few
  // roundings of values up to the grid's 32 cells: under 1e-5 of a cell), so each sample is that
  // cell's value with its neighbours' weights below 1e-5 (|map| < 6).
  const double near = 2 * 1e-5 * 6;
  EXPECT_LE((got[0] - p32[0]).abs().max().item<double>(), near);
  // A whole-cell translation (-3 cells in x, +2 in y): a shifted copy, zero where it left the grid.
  const at::Tensor shifted = got[1];
  EXPECT_LE((shifted.narrow(1, 0, g.nx - 3).narrow(2, 2, g.ny - 2) -
             p32[1].narrow(1, 3, g.nx - 3).narrow(2, 0, g.ny - 2))
                .abs()
                .max()
                .item<double>(),
            near);
  EXPECT_LE(shifted.narrow(1, g.nx - 3, 3).abs().max().item<double>(), near);
  EXPECT_LE(shifted.narrow(2, 0, 2).abs().max().item<double>(), near);
  // A turn and a fractional move, every cell against the reference in double. Bound: the
  // library computes the sampling point in float32 (|p| < 20 m: a few ulp of 20, ~1e-5 m, i.e.
  // 2e-5 cells), so each bilinear weight moves by 2e-5 and the sample by 4 x 2e-5 max|map| (|map|
  // < 5), plus the float32 storage of the map and the weighted sum (4 roundings of <= 5).
  const at::Tensor T = poses[2].to(at::kDouble);
  const double c = T[0][0].item<double>(), s = T[1][0].item<double>();
  const double tx = T[0][3].item<double>(), ty = T[1][3].item<double>();
  const double bound = 4 * 2e-5 * 5 + 8 * 5 * 6e-8;
  double worst = 0;
  for (int64_t i = 0; i < g.nx; ++i) {
    for (int64_t j = 0; j < g.ny; ++j) {
      const double x = g.x_min + (static_cast<double>(i) + 0.5) * g.resolution;
      const double y = g.y_min + (static_cast<double>(j) + 0.5) * g.resolution;
      const double px = c * (x - tx) + s * (y - ty), py = -s * (x - tx) + c * (y - ty);
      const auto want = sample(prev[2].to(at::kFloat).to(at::kDouble), g, px, py);
      for (int64_t ch = 0; ch < 2; ++ch)
        worst = std::max(worst,
                         std::abs(got[2][ch][i][j].item<double>() - want[static_cast<size_t>(ch)]));
    }
  }
  EXPECT_LE(worst, bound);
}

// A static world point: a blob centred on it in the previous frame's BEV lands, after alignment,
// centred on the same point seen from the current frame. Its centre of mass moves by no more than
// the blob's sampling (the blob's support is inside the grid in both frames; bilinear resampling of
// a smooth blob shifts its centroid by << a cell).
TEST(AlignBevTest, AStaticWorldPointStaysInItsCell) {
  const BevGrid g{-25, -25, 0.5, 100, 100};
  const double wx = 6.3, wy = -4.1;  // the point in the world (= the current ego frame here)
  for (auto [yaw, tx, ty] :
       {std::tuple{0.0, -1.7, 0.2}, std::tuple{0.12, -3.4, 1.1}, std::tuple{-0.3, -0.6, -2.5}}) {
    // The previous ego frame's pose in the current one, and the point in the previous frame.
    const at::Tensor T = pose2d(yaw, tx, ty);
    const double c = std::cos(yaw), s = std::sin(yaw);
    const double px = c * (wx - tx) + s * (wy - ty), py = -s * (wx - tx) + c * (wy - ty);
    const at::Tensor xs = g.x_min + (at::arange(g.nx, at::kDouble) + 0.5) * g.resolution;
    const at::Tensor ys = g.y_min + (at::arange(g.ny, at::kDouble) + 0.5) * g.resolution;
    const at::Tensor blob =
        at::exp(-((xs.view({-1, 1}) - px).pow(2) + (ys.view({1, -1}) - py).pow(2)) / (2 * 1.0));
    const at::Tensor aligned =
        align_bev(blob.view({1, 1, g.nx, g.ny}).to(at::kFloat), T.unsqueeze(0).to(at::kFloat), g)
            .to(at::kDouble)[0][0];
    const double m = aligned.sum().item<double>();
    const double cx = (aligned * xs.view({-1, 1})).sum().item<double>() / m;
    const double cy = (aligned * ys.view({1, -1})).sum().item<double>() / m;
    // Within a tenth of a cell of the point (measured: ~1e-3 m; the bilinear interpolation of a
    // Gaussian of sigma 2 cells biases its centroid by far less than that).
    EXPECT_NEAR(cx, wx, 0.1 * g.resolution) << yaw;
    EXPECT_NEAR(cy, wy, 0.1 * g.resolution) << yaw;
    // And the peak cell is the cell holding the point.
    const int64_t k = aligned.argmax().item<int64_t>();
    EXPECT_EQ(k / g.ny, static_cast<int64_t>(std::floor((wx - g.x_min) / g.resolution)));
    EXPECT_EQ(k % g.ny, static_cast<int64_t>(std::floor((wy - g.y_min) / g.resolution)));
  }
}

ModelConfig temporal_config(int frames, bool prev_grad) {
  ModelConfig cfg;
  cfg.name = "bev";
  cfg.size = "tiny";
  cfg.backbone = "conv";
  cfg.temporal.frames = frames;
  cfg.temporal.prev_grad = prev_grad;
  return cfg;
}

TEST(TemporalBevTest, UnitsCostsAndBatchChecks) {
  at::manual_seed(2);
  const ModelConfig cfg = temporal_config(3, false);
  auto model = std::dynamic_pointer_cast<PerceptionModel>(build_model(cfg, core::SceneSpec{}));
  ASSERT_TRUE(model);
  int64_t params = 0;
  for (const auto& c : analytic_cost(cfg, core::SceneSpec{})) params += c.params;
  EXPECT_EQ(model->parameter_count(), params);
  std::vector<std::string> names;
  for (const Unit& u : model->units()) names.push_back(u.name);
  EXPECT_EQ(names, (std::vector<std::string>{"encoder", "view", "temporal", "bev_block0",
                                             "bev_block1", "heads"}));
  EXPECT_EQ(model->chain_length(), 6);
  EXPECT_EQ(static_cast<int>(model->unit_flops().size()), 6);
  // The backbone and the view run on all 3 frames: 3x the single-frame model's FLOPs.
  const auto one = analytic_cost(temporal_config(1, false), core::SceneSpec{});
  const auto three = analytic_cost(cfg, core::SceneSpec{});
  EXPECT_EQ(three[0].flops, 3 * one[0].flops);
  EXPECT_EQ(three[1].flops, 3 * one[1].flops);
  EXPECT_EQ(three[2].name, "temporal");
  const auto batch = model->example_batch(2);
  const auto pred = model->forward(batch);
  EXPECT_EQ(pred.at("heatmap").size(0), 2);
  // A batch without the previous frames is one error naming the key and data.frames.
  core::TensorDict single = batch;
  single.erase("prev_images");
  try {
    model->forward(single);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("prev_images"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("data.frames = 3"), std::string::npos) << e.what();
  }
}

// prev_grad false (BEVDet4D): the same forward values, the same gradients for everything after
// the view (temporal fusion, BEV encoder, heads), and the image encoder's gradient from the
// current frame only; prev_grad true adds the previous frames' contribution.
TEST(TemporalBevTest, PreviousFramesRunWithoutGradientUnlessAsked) {
  at::manual_seed(3);
  auto a = build_model(temporal_config(2, false), core::SceneSpec{});
  auto b = build_model(temporal_config(2, true), core::SceneSpec{});
  {
    at::NoGradGuard ng;
    auto pa = a->named_parameters(), pb = b->named_parameters();
    for (const auto& item : pa) pb[item.key()].copy_(item.value());
  }
  const auto batch = a->example_batch(2);
  auto la = a->loss(batch, a->forward(batch)), lb = b->loss(batch, b->forward(batch));
  EXPECT_EQ(la.total.item<double>(), lb.total.item<double>());
  la.total.backward();
  lb.total.backward();
  auto ga = a->named_parameters(), gb = b->named_parameters();
  bool encoder_differs = false;
  for (const auto& item : ga) {
    const at::Tensor& g1 = item.value().grad();
    const at::Tensor& g2 = gb[item.key()].grad();
    ASSERT_TRUE(g1.defined() && g2.defined()) << item.key();
    if (item.key().rfind("encoder.", 0) == 0 || item.key().rfind("view.", 0) == 0) {
      encoder_differs = encoder_differs || !at::equal(g1, g2);
    } else {
      EXPECT_TRUE(at::equal(g1, g2)) << item.key();
    }
  }
  EXPECT_TRUE(encoder_differs);
}

}  // namespace
}  // namespace parallax::models
