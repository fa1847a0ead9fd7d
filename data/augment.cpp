#include "data/augment.h"

#include "core/rng.h"
#include "data/geometry.h"
#include "data/random.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace parallax::data {
namespace {

using geom::kDeg;

// Rounds half up after clamping (the same as std::round for the non-negative values left).
uint8_t to_byte(double v) {
  return static_cast<uint8_t>(std::clamp(v, 0.0, 255.0) + 0.5);
}

}  // namespace

AugmentParams draw_augment(const AugmentOptions& o, int64_t cameras, int64_t height, int64_t width,
                           uint64_t seed, int64_t epoch, int64_t scene) {
  Rng rng(core::derive_seed(core::derive_seed(seed, static_cast<uint64_t>(epoch),
                                              static_cast<uint64_t>(SeedStream::kAugment)),
                            static_cast<uint64_t>(scene), 0));
  AugmentParams p;
  if (o.geometric) {
    p.rotation_rad = rng.uniform(-o.rotate_deg, o.rotate_deg) * kDeg;
    p.flip_y = o.flip_y && rng.bernoulli(0.5);
  }
  for (int64_t k = 0; k < cameras; ++k) {
    CameraAugment a;
    if (o.geometric) {
      a.scale = rng.uniform(o.resize_min, o.resize_max);
      const double ex = a.scale * static_cast<double>(width) - static_cast<double>(width);
      const double ey = a.scale * static_cast<double>(height) - static_cast<double>(height);
      // Whole-pixel crops: the crop window starts on the resized image's pixel grid.
      a.ox = std::round(rng.uniform(std::min(0.0, ex), std::max(0.0, ex)));
      a.oy = std::round(rng.uniform(std::min(0.0, ey), std::max(0.0, ey)));
    }
    if (o.photometric) {
      a.brightness = rng.uniform(1 - o.brightness, 1 + o.brightness);
      a.contrast = rng.uniform(1 - o.contrast, 1 + o.contrast);
      a.saturation = rng.uniform(1 - o.saturation, 1 + o.saturation);
      a.hue_rad = rng.uniform(-o.hue_deg, o.hue_deg) * kDeg;
    }
    p.cameras.push_back(a);
  }
  return p;
}

void resize_crop(const uint8_t* src, uint8_t* dst, int64_t H, int64_t W, double s, double ox,
                 double oy) {
  if (s == 1.0 && ox == 0.0 && oy == 0.0) {
    std::memcpy(dst, src, static_cast<size_t>(H * W * 3));
    return;
  }
  // Separable bilinear taps: for each output column (row), two source columns (rows) clamped into
  // the image and their weights, a weight being 0 for a tap outside the image (zero padding).
  struct Tap {
    int64_t i0, i1;
    double w0, w1;
  };
  auto taps = [&](int64_t n_out, int64_t n_in, double off) {
    std::vector<Tap> t(static_cast<size_t>(n_out));
    for (int64_t i = 0; i < n_out; ++i) {
      const double x = (i + 0.5 + off) / s - 0.5;
      const double f = std::floor(x);
      const auto a = static_cast<int64_t>(f);
      const double w = x - f;
      Tap& k = t[static_cast<size_t>(i)];
      k.w0 = (a >= 0 && a < n_in) ? 1 - w : 0.0;
      k.w1 = (a + 1 >= 0 && a + 1 < n_in) ? w : 0.0;
      k.i0 = std::clamp<int64_t>(a, 0, n_in - 1);
      k.i1 = std::clamp<int64_t>(a + 1, 0, n_in - 1);
    }
    return t;
  };
  const std::vector<Tap> tx = taps(W, W, ox), ty = taps(H, H, oy);
  for (int64_t j = 0; j < H; ++j) {
    const Tap& r = ty[static_cast<size_t>(j)];
    const uint8_t* row0 = src + r.i0 * W * 3;
    const uint8_t* row1 = src + r.i1 * W * 3;
    uint8_t* out = dst + j * W * 3;
    for (int64_t i = 0; i < W; ++i) {
      const Tap& c = tx[static_cast<size_t>(i)];
      const double w00 = r.w0 * c.w0, w01 = r.w0 * c.w1, w10 = r.w1 * c.w0, w11 = r.w1 * c.w1;
      const uint8_t* a = row0 + c.i0 * 3;
      const uint8_t* b = row0 + c.i1 * 3;
      const uint8_t* d = row1 + c.i0 * 3;
      const uint8_t* e = row1 + c.i1 * 3;
      for (int k = 0; k < 3; ++k) {
        const double v = w00 * a[k] + w01 * b[k] + w10 * d[k] + w11 * e[k];
        out[i * 3 + k] = static_cast<uint8_t>(std::min(v, 255.0) + 0.5);
      }
    }
  }
}

void resample(const uint8_t* src, int64_t h_in, int64_t w_in, uint8_t* dst, int64_t h_out,
              int64_t w_out, double sx, double sy, double ox, double oy) {
  // Per output index, the source taps and weights of a triangle filter of radius r = max(1, 1/s)
  // source pixels centred on the output pixel's source point; weights are normalised over all
  // taps, those outside the image included and contributing 0 (zero padding).
  struct Taps {
    std::vector<int64_t> first;   // first tap's source index per output
    std::vector<int64_t> count;   // taps per output
    std::vector<double> weights;  // count weights per output, flattened
    std::vector<int64_t> start;   // offset into weights per output
  };
  auto taps = [](int64_t n_out, int64_t n_in, double s, double off) {
    Taps t;
    const double r = std::max(1.0, 1.0 / s);
    for (int64_t i = 0; i < n_out; ++i) {
      const double x = (static_cast<double>(i) + 0.5 + off) / s;  // continuous source coordinate
      const auto lo = static_cast<int64_t>(std::floor(x - r - 0.5));
      const auto hi = static_cast<int64_t>(std::ceil(x + r - 0.5));
      double total = 0;
      std::vector<double> w;
      for (int64_t j = lo; j <= hi; ++j) {
        const double v = std::max(0.0, 1.0 - std::abs(static_cast<double>(j) + 0.5 - x) / r);
        total += v;
        w.push_back(v);
      }
      const int64_t a = std::max<int64_t>(lo, 0), b = std::min<int64_t>(hi, n_in - 1);
      t.first.push_back(a);
      t.count.push_back(std::max<int64_t>(0, b - a + 1));
      t.start.push_back(static_cast<int64_t>(t.weights.size()));
      for (int64_t j = a; j <= b; ++j)
        t.weights.push_back(total > 0 ? w[static_cast<size_t>(j - lo)] / total : 0.0);
    }
    return t;
  };
  const Taps tx = taps(w_out, w_in, sx, ox), ty = taps(h_out, h_in, sy, oy);
  // Horizontal pass over the source rows the vertical taps use, in float; then each output row
  // as a weighted sum of whole rows (contiguous, so the compiler vectorises it).
  const int64_t row_len = w_out * 3;
  std::vector<float> tmp(static_cast<size_t>(h_in * row_len));
  std::vector<char> needed(static_cast<size_t>(h_in), 0);
  for (int64_t j = 0; j < h_out; ++j) {
    for (int64_t k = 0; k < ty.count[static_cast<size_t>(j)]; ++k)
      needed[static_cast<size_t>(ty.first[static_cast<size_t>(j)] + k)] = 1;
  }
  std::vector<float> wx(tx.weights.begin(), tx.weights.end());
  for (int64_t r = 0; r < h_in; ++r) {
    if (!needed[static_cast<size_t>(r)]) continue;
    const uint8_t* row = src + r * w_in * 3;
    float* out = tmp.data() + r * row_len;
    for (int64_t i = 0; i < w_out; ++i) {
      const float* wt = wx.data() + tx.start[static_cast<size_t>(i)];
      const int64_t f = tx.first[static_cast<size_t>(i)], n = tx.count[static_cast<size_t>(i)];
      const uint8_t* p = row + f * 3;
      float a0 = 0, a1 = 0, a2 = 0;
      for (int64_t k = 0; k < n; ++k) {
        a0 += wt[k] * p[k * 3];
        a1 += wt[k] * p[k * 3 + 1];
        a2 += wt[k] * p[k * 3 + 2];
      }
      out[i * 3] = a0;
      out[i * 3 + 1] = a1;
      out[i * 3 + 2] = a2;
    }
  }
  std::vector<float> acc(static_cast<size_t>(row_len));
  for (int64_t j = 0; j < h_out; ++j) {
    const double* wt = ty.weights.data() + ty.start[static_cast<size_t>(j)];
    const int64_t f = ty.first[static_cast<size_t>(j)], n = ty.count[static_cast<size_t>(j)];
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k = 0; k < n; ++k) {
      const float w = static_cast<float>(wt[k]);
      const float* in = tmp.data() + (f + k) * row_len;
      float* a = acc.data();
      for (int64_t i = 0; i < row_len; ++i) a[i] += w * in[i];
    }
    uint8_t* out = dst + j * row_len;
    for (int64_t i = 0; i < row_len; ++i)
      out[i] = static_cast<uint8_t>(std::clamp(acc[static_cast<size_t>(i)], 0.0f, 255.0f) + 0.5f);
  }
}

void fit_images(SceneRecord& scene, const ImageFit& fit) {
  const at::Tensor src = scene.images.contiguous();
  const int64_t N = src.size(0), h = src.size(1), w = src.size(2);
  at::Tensor out = at::empty({N, fit.height, fit.width, 3}, at::kByte);
  at::Tensor K = scene.intrinsics.contiguous().clone();
  for (int64_t k = 0; k < N; ++k) {
    resample(src.data_ptr<uint8_t>() + k * h * w * 3, h, w,
             out.data_ptr<uint8_t>() + k * fit.height * fit.width * 3, fit.height, fit.width,
             fit.sx, fit.sy, 0, 0);
    float* Kp = K.data_ptr<float>() + k * 9;
    for (int c = 0; c < 3; ++c) {
      Kp[c] = static_cast<float>(fit.sx * Kp[c]);
      Kp[3 + c] = static_cast<float>(fit.sy * Kp[3 + c]);
    }
  }
  scene.images = out;
  scene.intrinsics = K;
}

void photometric(uint8_t* img, int64_t H, int64_t W, const CameraAugment& a) {
  if (a.brightness == 1 && a.contrast == 1 && a.saturation == 1 && a.hue_rad == 0) return;
  const int64_t n = H * W;
  // Every step is affine in RGB, so compose them into one matrix M and offset c.
  double mean_grey = 0;
  for (int64_t i = 0; i < n; ++i) {
    mean_grey += 0.299 * img[i * 3] + 0.587 * img[i * 3 + 1] + 0.114 * img[i * 3 + 2];
  }
  mean_grey /= static_cast<double>(std::max<int64_t>(1, n));
  // RGB <-> YIQ.
  const double to_yiq[3][3] = {
      {0.299, 0.587, 0.114}, {0.595716, -0.274453, -0.321263}, {0.211456, -0.522591, 0.311135}};
  double to_rgb[3][3];  // the exact inverse, so identity parameters give the identity map
  {
    const auto& m = to_yiq;
    const double det = m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) -
                       m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0]) +
                       m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]);
    for (int r = 0; r < 3; ++r) {
      for (int c = 0; c < 3; ++c) {
        // Cofactor (c, r) / det.
        const int r1 = (c + 1) % 3, r2 = (c + 2) % 3, c1 = (r + 1) % 3, c2 = (r + 2) % 3;
        to_rgb[r][c] = (m[r1][c1] * m[r2][c2] - m[r1][c2] * m[r2][c1]) / det;
      }
    }
  }
  // In YIQ: brightness scales all, contrast scales around the mean grey (Y only has an offset),
  // saturation scales I and Q, hue rotates (I, Q).
  const double b = a.brightness, k = a.contrast, sat = a.saturation;
  const double ch = std::cos(a.hue_rad), sh = std::sin(a.hue_rad);
  double yiq_m[3][3] = {{b * k, 0, 0},
                        {0, b * k * sat * ch, -b * k * sat * sh},
                        {0, b * k * sat * sh, b * k * sat * ch}};
  const double y_offset = (1 - k) * b * mean_grey;
  double M[3][3] = {};
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 3; ++c) {
      double v = 0;
      for (int p = 0; p < 3; ++p) {
        for (int q = 0; q < 3; ++q) v += to_rgb[r][p] * yiq_m[p][q] * to_yiq[q][c];
      }
      M[r][c] = v;
    }
  }
  const double off[3] = {to_rgb[0][0] * y_offset, to_rgb[1][0] * y_offset, to_rgb[2][0] * y_offset};
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* p = img + i * 3;
    const double r = p[0], g = p[1], bl = p[2];
    for (int c = 0; c < 3; ++c) p[c] = to_byte(M[c][0] * r + M[c][1] * g + M[c][2] * bl + off[c]);
  }
}

std::vector<double> bev_transform(double rot, bool flip) {
  const double c = std::cos(rot), s = std::sin(rot), f = flip ? -1.0 : 1.0;
  // Rz(rot) * diag(1, f, 1)
  return {c, -s * f, 0, s, c * f, 0, 0, 0, 1};
}

std::vector<int> box_to_bev_classes(const DatasetInfo& info) {
  std::vector<int> out;
  for (const auto& name : info.box_classes) {
    const auto it = std::find(info.bev_classes.begin(), info.bev_classes.end(), name);
    out.push_back(it == info.bev_classes.end() ? -1
                                               : static_cast<int>(it - info.bev_classes.begin()));
  }
  return out;
}

SceneRecord apply_augment(const SceneRecord& in, const AugmentParams& p, const BevGrid& grid,
                          const std::vector<int>& box_to_bev, const ImageFit* fit) {
  SceneRecord out;
  out.index = in.index;
  out.sample_token = in.sample_token;
  out.sequence = in.sequence;
  out.frame = in.frame;
  out.prev_index = in.prev_index;
  out.timestamp_us = in.timestamp_us;
  const int64_t N = in.images.size(0), H = in.images.size(1), W = in.images.size(2);
  const int64_t Ho = fit ? fit->height : H, Wo = fit ? fit->width : W;
  const double fx = fit ? fit->sx : 1.0, fy = fit ? fit->sy : 1.0;
  const at::Tensor src_img = in.images.contiguous();
  out.images = at::empty({N, Ho, Wo, 3}, at::kByte);
  out.intrinsics = at::empty_like(in.intrinsics.contiguous());
  const at::Tensor K_in = in.intrinsics.contiguous();
  for (int64_t k = 0; k < N; ++k) {
    const CameraAugment& a = p.cameras.at(static_cast<size_t>(k));
    uint8_t* dst = out.images.data_ptr<uint8_t>() + k * Ho * Wo * 3;
    if (fit) {
      // The fit and the augmentation's resize in one resampling: u' = s (f u) - o.
      resample(src_img.data_ptr<uint8_t>() + k * H * W * 3, H, W, dst, Ho, Wo, a.scale * fx,
               a.scale * fy, a.ox, a.oy);
    } else {
      resize_crop(src_img.data_ptr<uint8_t>() + k * H * W * 3, dst, H, W, a.scale, a.ox, a.oy);
    }
    photometric(dst, Ho, Wo, a);
    const float* K = K_in.data_ptr<float>() + k * 9;
    float* Ko = out.intrinsics.data_ptr<float>() + k * 9;
    // K' = S K with S = [[s fx, 0, -ox], [0, s fy, -oy], [0, 0, 1]] (fx = fy = 1 without a fit).
    for (int c = 0; c < 3; ++c) {
      Ko[0 * 3 + c] = static_cast<float>(a.scale * fx * K[0 * 3 + c] - a.ox * K[2 * 3 + c]);
      Ko[1 * 3 + c] = static_cast<float>(a.scale * fy * K[1 * 3 + c] - a.oy * K[2 * 3 + c]);
      Ko[2 * 3 + c] = K[2 * 3 + c];
    }
  }

  const std::vector<double> A = bev_transform(p.rotation_rad, p.flip_y);
  // cam_to_ego' = [A 0; 0 1] cam_to_ego.
  const at::Tensor T_in = in.cam_to_ego.contiguous();
  out.cam_to_ego = at::empty_like(T_in);
  for (int64_t k = 0; k < N; ++k) {
    const float* T = T_in.data_ptr<float>() + k * 16;
    float* To = out.cam_to_ego.data_ptr<float>() + k * 16;
    for (int c = 0; c < 4; ++c) {
      for (int r = 0; r < 3; ++r) {
        To[r * 4 + c] =
            static_cast<float>(A[r * 3 + 0] * T[0 * 4 + c] + A[r * 3 + 1] * T[1 * 4 + c] +
                               A[r * 3 + 2] * T[2 * 4 + c]);
      }
      To[3 * 4 + c] = T[3 * 4 + c];
    }
  }

  // Boxes: centre through A, yaw mirrored then rotated; drop those leaving the grid. A box's
  // velocity is a vector in the same frame: through A's 2x2 block (NaN, unknown, stays NaN).
  const at::Tensor B_in = in.boxes.contiguous();
  const bool has_vel = in.velocities.defined(), has_ids = in.instance_ids.defined();
  const at::Tensor V_in = has_vel ? in.velocities.contiguous() : at::Tensor();
  const at::Tensor I_in = has_ids ? in.instance_ids.to(at::kLong).contiguous() : at::Tensor();
  std::vector<float> rows, vel;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < B_in.size(0); ++i) {
    const float* b = B_in.data_ptr<float>() + i * kBoxColumns;
    const double x = A[0] * b[kBoxX] + A[1] * b[kBoxY], y = A[3] * b[kBoxX] + A[4] * b[kBoxY];
    if (x < grid.x_min || x >= grid.x_max || y < grid.y_min || y >= grid.y_max) continue;
    std::vector<float> r(b, b + kBoxColumns);
    r[kBoxX] = static_cast<float>(x);
    r[kBoxY] = static_cast<float>(y);
    const double yaw = (p.flip_y ? -b[kBoxYaw] : b[kBoxYaw]) + p.rotation_rad;
    r[kBoxYaw] = static_cast<float>(geom::wrap_angle(yaw));
    rows.insert(rows.end(), r.begin(), r.end());
    if (has_ids) ids.push_back(I_in.data_ptr<int64_t>()[i]);
    if (has_vel) {
      const float* v = V_in.data_ptr<float>() + i * 2;
      vel.push_back(static_cast<float>(A[0] * v[0] + A[1] * v[1]));
      vel.push_back(static_cast<float>(A[3] * v[0] + A[4] * v[1]));
    }
  }
  const auto K = static_cast<int64_t>(rows.size()) / kBoxColumns;
  out.boxes = at::empty({K, kBoxColumns}, at::kFloat);
  std::copy(rows.begin(), rows.end(), out.boxes.data_ptr<float>());
  if (has_vel) {
    out.velocities = at::empty({K, 2}, at::kFloat);
    std::copy(vel.begin(), vel.end(), out.velocities.data_ptr<float>());
  }
  if (has_ids) {
    out.instance_ids = at::empty({K}, at::kLong);
    std::copy(ids.begin(), ids.end(), out.instance_ids.data_ptr<int64_t>());
  }
  // The augmented ego frame is A times the stored one: ego_to_global' = ego_to_global [A^T 0; 0 1]
  // (A is orthogonal), so a point keeps its global position.
  if (in.ego_to_global.defined()) {
    const at::Tensor E = in.ego_to_global.to(at::kDouble).contiguous();
    out.ego_to_global = E.clone();
    const double* e = E.data_ptr<double>();
    double* o = out.ego_to_global.data_ptr<double>();
    for (int r = 0; r < 4; ++r) {
      for (int c = 0; c < 3; ++c)
        o[r * 4 + c] =
            e[r * 4 + 0] * A[c * 3 + 0] + e[r * 4 + 1] * A[c * 3 + 1] + e[r * 4 + 2] * A[c * 3 + 2];
    }
  }

  // BEV labels: each new cell takes the label of the cell under A^-1 of its centre (A^-1 = A^T).
  const at::Tensor S_in = in.bev_semantics.contiguous();
  const int64_t X = S_in.size(0), Y = S_in.size(1);
  out.bev_semantics = at::empty_like(S_in);
  const uint8_t* src = S_in.data_ptr<uint8_t>();
  uint8_t* dst = out.bev_semantics.data_ptr<uint8_t>();
  const double res = grid.resolution;
  for (int64_t i = 0; i < X; ++i) {
    for (int64_t j = 0; j < Y; ++j) {
      const double xn = grid.x_min + (i + 0.5) * res, yn = grid.y_min + (j + 0.5) * res;
      const double xs = A[0] * xn + A[3] * yn, ys = A[1] * xn + A[4] * yn;
      const int64_t si =
          std::clamp<int64_t>(static_cast<int64_t>(std::floor((xs - grid.x_min) / res)), 0, X - 1);
      const int64_t sj =
          std::clamp<int64_t>(static_cast<int64_t>(std::floor((ys - grid.y_min) / res)), 0, Y - 1);
      dst[i * Y + j] = src[si * Y + sj];
    }
  }
  // Objects again, exactly, from the moved boxes: footprints first, then centre cells.
  const float* bp = out.boxes.data_ptr<float>();
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t k = 0; k < K; ++k) {
      const float* b = bp + k * kBoxColumns;
      const auto c = static_cast<size_t>(b[kBoxClass]);
      if (c >= box_to_bev.size() || box_to_bev[c] < 0) continue;
      const auto cls = static_cast<uint8_t>(box_to_bev[c]);
      if (pass == 1) {
        const auto i = static_cast<int64_t>(std::floor((b[kBoxX] - grid.x_min) / res));
        const auto j = static_cast<int64_t>(std::floor((b[kBoxY] - grid.y_min) / res));
        if (i >= 0 && i < X && j >= 0 && j < Y) dst[i * Y + j] = cls;
        continue;
      }
      const geom::Box box{b[kBoxX], b[kBoxY], b[kBoxZ], b[kBoxL], b[kBoxW], b[kBoxH], b[kBoxYaw]};
      const double r = 0.5 * std::hypot(box.l, box.w);
      const int64_t i0 =
          std::max<int64_t>(0, static_cast<int64_t>(std::floor((box.x - r - grid.x_min) / res)));
      const int64_t i1 = std::min<int64_t>(
          X - 1, static_cast<int64_t>(std::floor((box.x + r - grid.x_min) / res)));
      const int64_t j0 =
          std::max<int64_t>(0, static_cast<int64_t>(std::floor((box.y - r - grid.y_min) / res)));
      const int64_t j1 = std::min<int64_t>(
          Y - 1, static_cast<int64_t>(std::floor((box.y + r - grid.y_min) / res)));
      for (int64_t i = i0; i <= i1; ++i) {
        for (int64_t j = j0; j <= j1; ++j) {
          if (box.footprint_contains(grid.x_min + (i + 0.5) * res, grid.y_min + (j + 0.5) * res))
            dst[i * Y + j] = cls;
        }
      }
    }
  }
  return out;
}

}  // namespace parallax::data
