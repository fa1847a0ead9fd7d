// CenterPoint target encoding, losses and decoding on random boxes.
#include "models/detection.h"
#include "models/model.h"
#include "models/perception_model.h"
#include "tests/common/tolerance.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

namespace parallax::models {
namespace {

namespace tol = parallax::testing;
using tol::u;

const BevGrid kGrid{-25, -25, 1.0, 50, 50};

// `n` random boxes per sample at distinct centre cells (at least 3 cells apart), padded to k rows.
at::Tensor random_boxes(int64_t b, int64_t n, int64_t k, int64_t classes) {
  at::Tensor boxes = at::zeros({b, k, 9});
  boxes.select(-1, 7).fill_(-1);
  for (int64_t s = 0; s < b; ++s) {
    // Distinct cells on a coarse lattice, then a random offset inside the cell.
    const at::Tensor cells = at::randperm(16 * 16).narrow(0, 0, n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = cells[i].item<int64_t>();
      const double x =
          -25 + 3 * static_cast<double>(c / 16) + 1 + at::rand({}).item<double>() * 0.999;
      const double y =
          -25 + 3 * static_cast<double>(c % 16) + 1 + at::rand({}).item<double>() * 0.999;
      const at::Tensor size = 0.5 + 4 * at::rand({3});
      boxes[s][i] = at::tensor(
          {x, y, 0.3 + at::rand({}).item<double>(), size[0].item<double>(), size[1].item<double>(),
           size[2].item<double>(), (at::rand({}).item<double>() * 2 - 1) * 3.1,
           static_cast<double>(at::randint(classes, {}).item<int64_t>()),
           0.2 + 0.8 * at::rand({}).item<double>()},
          at::kFloat);
    }
  }
  return boxes;
}

TEST(DetectionTargetsTest, HeatmapPeaksAtBoxCentres) {
  at::manual_seed(21);
  at::Tensor boxes = random_boxes(2, 6, 10, 3);
  boxes[1][5][8] = 0;  // invisible: not a target
  const DetectionTargets t = encode_detection_targets(boxes, kGrid, 3);
  ASSERT_EQ(t.heatmap.sizes(), at::IntArrayRef({2, 3, 50, 50}));
  EXPECT_EQ(t.mask.sum().item<int64_t>(), 11);
  for (int64_t s = 0; s < 2; ++s) {
    for (int64_t i = 0; i < 10; ++i) {
      const int64_t cls = boxes[s][i][7].item<int64_t>();
      const int64_t ci = static_cast<int64_t>(std::floor(boxes[s][i][0].item<double>() + 25));
      const int64_t cj = static_cast<int64_t>(std::floor(boxes[s][i][1].item<double>() + 25));
      if (cls < 0) continue;
      const bool target = t.mask[s][i].item<bool>();
      EXPECT_EQ(target, i != 5 || s != 1);
      if (target) {
        EXPECT_EQ(t.heatmap[s][cls][ci][cj].item<float>(), 1.0f);
        EXPECT_EQ(t.index[s][i].item<int64_t>(), ci * 50 + cj);
        // A strict local maximum of its class channel.
        const at::Tensor patch =
            t.heatmap[s][cls].narrow(0, ci - 1, 3).narrow(1, cj - 1, 3).reshape({-1});
        EXPECT_EQ((patch == 1).sum().item<int64_t>(), 1);
      }
    }
  }
  // Exactly the target centres are 1; everything else is below.
  EXPECT_EQ((t.heatmap == 1).sum().item<int64_t>(), 11);
  EXPECT_GE(t.heatmap.min().item<float>(), 0.0f);
}

TEST(DetectionTargetsTest, RegressionLossIsZeroAtTheEncodedTarget) {
  at::manual_seed(22);
  const at::Tensor boxes = random_boxes(3, 5, 8, 3);
  const DetectionTargets t = encode_detection_targets(boxes, kGrid, 3);
  // A prediction map holding each target's code at its centre cell, noise elsewhere.
  at::Tensor reg = at::randn({3, kBoxCodeSize, 2500});
  const at::Tensor idx = t.index.unsqueeze(1).expand({3, kBoxCodeSize, 8});
  const at::Tensor codes =
      at::where(t.mask.unsqueeze(-1), t.codes, reg.gather(2, idx).transpose(1, 2));
  reg.scatter_(2, idx, codes.transpose(1, 2));
  reg = reg.view({3, kBoxCodeSize, 50, 50});
  // Exact by construction: the prediction holds the very code values (the boxes sit in distinct
  // cells), so every |pred - code| is 0.
  EXPECT_EQ(box_regression_loss(reg, t).item<double>(), 0.0);
  // Off by 0.3 in one code entry of one box: L1 = 0.3 / number of boxes. The only nonzero term is
  // fl(fl(c + 0.3) - c), within u (|c| + 0.3) + u 0.3 of 0.3; the sum of zeros adds nothing, the
  // division by 15 one rounding.
  const int64_t cell = t.index[1][2].item<int64_t>();
  const double c = reg[1][4][cell / 50][cell % 50].item<double>();
  reg[1][4][cell / 50][cell % 50] += 0.3;
  EXPECT_NEAR(box_regression_loss(reg, t).item<double>(), 0.3 / 15,
              tol::gamma_k(3) * (std::abs(c) + 0.6) / 15);
}

TEST(DetectionTargetsTest, PostprocessOfEncodedTargetsRecoversTheBoxes) {
  at::manual_seed(23);
  ModelConfig cfg;
  cfg.name = "bev";
  cfg.backbone = "conv";
  PerceptionModel model(make_bev_spec(cfg, core::SceneSpec{}));
  ASSERT_EQ(model.spec().query_grid.nx, 50);
  const at::Tensor boxes = random_boxes(2, 7, 12, 3);
  const DetectionTargets t = encode_detection_targets(boxes, model.spec().query_grid, 3);
  // Heatmap logits from the target heatmap; codes scattered at the centre cells.
  const at::Tensor heat_logits = at::logit(t.heatmap, 1e-4);
  at::Tensor reg = at::zeros({2, kBoxCodeSize, 2500});
  reg.scatter_(2, t.index.unsqueeze(1).expand({2, kBoxCodeSize, 12}),
               (t.codes * t.mask.unsqueeze(-1)).transpose(1, 2).contiguous());
  core::TensorDict pred{{"bev_logits", at::randn({2, 6, 100, 100})},
                        {"heatmap", heat_logits},
                        {"box_reg", reg.view({2, kBoxCodeSize, 50, 50})}};
  const auto out = model.postprocess(pred);
  ASSERT_EQ(out.at("det_boxes").sizes(), at::IntArrayRef({2, 100, 9}));
  ASSERT_EQ(out.at("bev_labels").sizes(), at::IntArrayRef({2, 100, 100}));
  for (int64_t s = 0; s < 2; ++s) {
    const at::Tensor det = out.at("det_boxes")[s];
    const at::Tensor keep = det.select(-1, 7) >= 0;
    ASSERT_EQ(keep.sum().item<int64_t>(), 7) << det;
    EXPECT_EQ((out.at("det_scores")[s] > 0).sum().item<int64_t>(), 7);
    // Compare as sets: sort both by x.
    const at::Tensor got = det.index({keep});
    const at::Tensor want = boxes[s].narrow(0, 0, 7).clone();
    want.select(-1, 8).fill_(1);  // decoded visibility is 1
    const at::Tensor g = got.index_select(0, got.select(-1, 0).argsort());
    const at::Tensor w = want.index_select(0, want.select(-1, 0).argsort());
    // Yaw: encoded as fp32 sin and cos (each within 2 u, one ulp), decoded by atan2 (angle within
    // 2 sqrt(2) u from those, plus one ulp of a result <= pi, 4 u); the test's difference of two
    // angles <= pi rounds by 4 u, its sin, cos and atan2 near 0 add 2 sqrt(2) u: under 16 u.
    at::Tensor dyaw = g.select(-1, 6) - w.select(-1, 6);
    dyaw = at::atan2(dyaw.sin(), dyaw.cos());
    EXPECT_LT(dyaw.abs().max().item<double>(), 16 * u);
    g.select(-1, 6).zero_();
    w.select(-1, 6).zero_();
    // x, y: encoded (x - x_min) / res, the cell's offset (exact), decoded x_min + (i + offset) res:
    // 5 roundings of |x - x_min| + |x|. z, class and visibility are copied: exact. Sizes: log then
    // exp (each within 2 u, one ulp) and the log's error scaled by the size: (4 + 2 |log l|) u l.
    const double x_min = model.spec().query_grid.x_min, y_min = model.spec().query_grid.y_min;
    const at::Tensor w64 = w.to(at::kDouble);
    at::Tensor bound = at::zeros_like(w64);
    bound.select(-1, 0).copy_(tol::gamma_k(5) *
                              ((w64.select(-1, 0) - x_min).abs() + w64.select(-1, 0).abs()));
    bound.select(-1, 1).copy_(tol::gamma_k(5) *
                              ((w64.select(-1, 1) - y_min).abs() + w64.select(-1, 1).abs()));
    const at::Tensor size = w64.narrow(-1, 3, 3);
    bound.narrow(-1, 3, 3).copy_((4 + 2 * size.log().abs()) * u * size * (1 + 1e-3));
    EXPECT_TRUE(tol::within(g, w, bound)) << g << w;
  }
}

// Velocity codes (model.velocity): a known velocity entry adds 0.2 |pred - v| to its box's sum; an
// unknown one (NaN) and a non-target box add nothing; decoding hands the codes back per detection.
TEST(DetectionTargetsTest, VelocityCodesTrainOnlyKnownEntriesAndDecode) {
  at::manual_seed(25);
  const int64_t b = 2, n = 4, k = 6, cs = box_code_size(true);
  ASSERT_EQ(cs, 10);
  const at::Tensor boxes = random_boxes(b, n, k, 3);
  at::Tensor vel = at::rand({b, k, 2}) * 16 - 8;
  vel[0][1][0] = NAN;              // box (0, 1): vx unknown, vy known
  vel[1][2] = at::full({2}, NAN);  // box (1, 2): both unknown
  const DetectionTargets t = encode_detection_targets(boxes, kGrid, 3, vel);
  ASSERT_EQ(t.mask.sum().item<int64_t>(), b * n);
  // Padding rows (class -1) are not targets, so their finite random velocities are masked too.
  EXPECT_EQ(t.velocity_mask.sum().item<int64_t>(), b * n * 2 - 3);
  EXPECT_FALSE(at::isnan(t.velocity).any().item<bool>());
  // A prediction holding every code and known velocity exactly: loss 0.
  at::Tensor reg = at::randn({b, cs, 2500});
  const at::Tensor idx = t.index.unsqueeze(1).expand({b, cs, k});
  const at::Tensor full = at::cat({t.codes, t.velocity}, -1);
  const at::Tensor codes =
      at::where(t.mask.unsqueeze(-1), full, reg.gather(2, idx).transpose(1, 2));
  reg.scatter_(2, idx, codes.transpose(1, 2));
  at::Tensor reg4 = reg.view({b, cs, 50, 50});
  EXPECT_EQ(box_regression_loss(reg4, t).item<double>(), 0.0);
  // The unknown entries hold 0 in the prediction (the masked target); moving them changes nothing.
  auto at_cell = [&](int64_t s, int64_t row, int64_t ch) {
    const int64_t cell = t.index[s][row].item<int64_t>();
    return reg4[s][ch][cell / 50][cell % 50];
  };
  at_cell(0, 1, 8) += 5.0;
  at_cell(1, 2, 8) += 5.0;
  at_cell(1, 2, 9) -= 5.0;
  EXPECT_EQ(box_regression_loss(reg4, t).item<double>(), 0.0);
  // A known entry off by 1.5: 0.2 * 1.5 / 8 boxes. Rounding: fl(fl(v + 1.5) - v) within
  // u (|v| + 3) of 1.5 with |v| <= 8, times 0.2 and the sum and division (3 more roundings).
  at_cell(0, 1, 9) += 1.5;
  EXPECT_NEAR(box_regression_loss(reg4, t).item<double>(), kVelocityCodeWeight * 1.5 / 8,
              tol::gamma_k(5) * 0.2 * (8 + 3) / 8);
  // Without velocity targets (a dataset without velocities) the 10-channel head trains its first
  // 8 entries only.
  const DetectionTargets t8 = encode_detection_targets(boxes, kGrid, 3);
  EXPECT_FALSE(t8.velocity.defined());
  EXPECT_EQ(box_regression_loss(reg4, t8).item<double>(), 0.0);

  // Decoding: each detection's velocity is the code at its cell.
  const at::Tensor heat_logits = at::logit(t.heatmap, 1e-4);
  const Detections d = decode_detections(heat_logits, reg4, kGrid, 20, 0.5);
  ASSERT_TRUE(d.velocities.defined());
  ASSERT_EQ(d.velocities.sizes(), at::IntArrayRef({b, 20, 2}));
  for (int64_t s = 0; s < b; ++s) {
    for (int64_t r = 0; r < n; ++r) {
      // Find the detection at this box's centre cell by position: same x within the code's
      // rounding (the box sits alone in its cell).
      const at::Tensor dx = (d.boxes[s].select(-1, 0) - boxes[s][r][0]).abs() +
                            (d.boxes[s].select(-1, 1) - boxes[s][r][1]).abs();
      const int64_t j = dx.argmin().item<int64_t>();
      ASSERT_LT(dx[j].item<double>(), 1e-4);
      for (int64_t c = 0; c < 2; ++c) {
        EXPECT_EQ(d.velocities[s][j][c].item<float>(), at_cell(s, r, 8 + c).item<float>())
            << s << " " << r << " " << c;
      }
    }
    // Rows past the kept detections are padding: velocity 0.
    const at::Tensor pad = d.boxes[s].select(-1, 7) < 0;
    EXPECT_EQ(d.velocities[s].index({pad}).abs().sum().item<double>(), 0.0);
  }
  // An 8-channel head decodes no velocities.
  EXPECT_FALSE(
      decode_detections(heat_logits, reg4.narrow(1, 0, 8), kGrid, 20, 0.5).velocities.defined());
}

TEST(FocalLossTest, MatchesTheCenterNetFormula) {
  at::manual_seed(24);
  const at::Tensor logits = at::randn({2, 3, 6, 6}) * 2;
  at::Tensor target = at::rand({2, 3, 6, 6}) * 0.9;
  target[0][1][2][3] = 1;
  target[1][2][0][0] = 1;
  const at::Tensor p = at::sigmoid(logits).to(at::kDouble), t = target.to(at::kDouble);
  // The reference, in double, from the same fp32 probabilities p (sigmoid within 2 u of exact).
  // Per term: positives (1 - p)^2 (-log p): the loss's log_sigmoid(x) is within 3 u of -log of
  // the exact p, the reference's log(p) within 2 u (absolute: |dp| / p) of it, plus the square and
  // the product: (1 - p)^2 (5 u |log p| + 2 u) + 4 u term. Negatives (1 - t)^4 p^2 (-log(1 - p)):
  // 1 - t rounds by u / (1 - t) relative (4 x for the power), p^2 and the products 6 u, and
  // log(1 - p) of the rounded p is off by 2 u p / (1 - p) (absolute). The sum of 72 non-negative
  // terms adds gamma(72) of their sum, the division by 2 positives nothing.
  double expect = 0, bound = 0;
  auto pa = p.accessor<double, 4>();
  auto ta = t.accessor<double, 4>();
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 3; ++b)
      for (int c = 0; c < 6; ++c)
        for (int d = 0; d < 6; ++d) {
          const double pp = pa[a][b][c][d], tt = ta[a][b][c][d];
          if (tt == 1) {
            const double term = -std::pow(1 - pp, 2) * std::log(pp);
            expect += term;
            bound += std::pow(1 - pp, 2) * (5 * u * std::abs(std::log(pp)) + 2 * u) + 4 * u * term;
          } else {
            const double term = -std::pow(1 - tt, 4) * pp * pp * std::log(1 - pp);
            expect += term;
            bound += term * (4 * u / (1 - tt) + 12 * u) +
                     std::pow(1 - tt, 4) * pp * pp * 2 * u * pp / (1 - pp);
          }
        }
  bound += tol::gamma_k(72) * expect;
  EXPECT_NEAR(heatmap_focal_loss(logits, target).item<double>(), expect / 2, bound / 2);
  // A confident correct prediction beats an uninformed one.
  EXPECT_LT(heatmap_focal_loss(at::logit(target, 1e-3), target).item<double>(),
            heatmap_focal_loss(at::zeros_like(target), target).item<double>());
}

TEST(DecodeTest, KeepsOnlyLocalMaximaAboveThreshold) {
  at::Tensor heat = at::full({1, 2, 10, 10}, -10.0);
  heat[0][0][3][3] = 3.0;   // peak
  heat[0][0][3][4] = 2.0;   // suppressed neighbour
  heat[0][1][7][7] = -1.0;  // sigmoid 0.27: kept at 0.2, dropped at 0.3
  const at::Tensor reg = at::zeros({1, kBoxCodeSize, 10, 10});
  const BevGrid g{0, 0, 2.0, 10, 10};
  Detections d = decode_detections(heat, reg, g, 5, 0.2);
  ASSERT_EQ(d.boxes.sizes(), at::IntArrayRef({1, 5, 9}));
  EXPECT_EQ((d.boxes[0].select(-1, 7) >= 0).sum().item<int64_t>(), 2);
  EXPECT_EQ(d.boxes[0][0][0].item<double>(), 6.0);  // x = 0 + (3 + 0) * 2: small integers, exact
  EXPECT_EQ(d.boxes[0][0][3].item<double>(), 1.0);  // exp(0) = 1 exactly
  EXPECT_EQ(d.boxes[0][1][7].item<float>(), 1.0f);
  // sigmoid in fp32: exp (one ulp, 2 u), the add and the division: within 4 u of the value.
  EXPECT_NEAR(d.scores[0][0].item<double>(), 1 / (1 + std::exp(-3.0)),
              4 * u / (1 + std::exp(-3.0)));
  d = decode_detections(heat, reg, g, 5, 0.3);
  EXPECT_EQ((d.boxes[0].select(-1, 7) >= 0).sum().item<int64_t>(), 1);
  EXPECT_EQ(d.scores[0][1].item<float>(), 0.0f);
  EXPECT_EQ(d.boxes[0][1][7].item<float>(), -1.0f);
}

}  // namespace
}  // namespace parallax::models
