// One nuScenes keyframe sample into one Parallax scene (data/nuscenes_impl.h, `Converter`).
#if PARALLAX_WITH_NUSCENES

#include "data/nuscenes_impl.h"

#include "core/error.h"
#include "core/strings.h"
#include "data/jpeg.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

namespace parallax::data::nusc {

std::string Converter::channel_of(const json& sd) const {
  const json& cs =
      calibrated_sensor.at(str(sample_data, sd, "calibrated_sensor_token"), where(sample_data, sd));
  const json& se =
      sensor.at(str(calibrated_sensor, cs, "sensor_token"), where(calibrated_sensor, cs));
  return str(sensor, se, "channel");
}

void Converter::index() {
  for (const auto& sd : sample_data.rows) {
    const json& kf = field(sample_data, sd, "is_key_frame");
    if (!kf.is_boolean() || !kf.get<bool>()) continue;
    const std::string s = str(sample_data, sd, "sample_token");
    sample.at(s, where(sample_data, sd));
    keyframes[s][channel_of(sd)] = &sd;
  }
  for (const auto& a : annotation.rows) {
    const std::string s = str(annotation, a, "sample_token");
    sample.at(s, where(annotation, a));
    anns[s].push_back(&a);
  }
}

const NuMap* Converter::map_of(const json& s) const {
  if (maps.empty()) return nullptr;
  const json& sc = scene.at(str(sample, s, "scene_token"), where(sample, s));
  const json& lg = log.at(str(scene, sc, "log_token"), where(scene, sc));
  return &maps.at(str(log, lg, "location"));
}

double Converter::timestamp_s(const json& ann) const {
  const json& s = sample.at(str(annotation, ann, "sample_token"), where(annotation, ann));
  return num(sample, s, "timestamp") * 1e-6;
}

// The devkit's box velocity (global frame): the centre difference between the previous and the
// next annotation of the instance over their time difference (or between this one and the one
// neighbour there is); NaN without a neighbour or over more than 1.5 s (3 s with both).
std::array<double, 2> Converter::velocity(const json& a) const {
  const std::string prev = str(annotation, a, "prev"), next = str(annotation, a, "next");
  const json* first = &a;
  const json* last = &a;
  if (!prev.empty()) first = &annotation.at(prev, where(annotation, a));
  if (!next.empty()) last = &annotation.at(next, where(annotation, a));
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (first == last) return {nan, nan};
  const auto p0 = nums(annotation, *first, "translation", 3);
  const auto p1 = nums(annotation, *last, "translation", 3);
  const double dt = timestamp_s(*last) - timestamp_s(*first);
  const double max_dt = (!prev.empty() && !next.empty()) ? 3.0 : 1.5;
  if (!(dt > 0) || dt > max_dt) return {nan, nan};
  return {(p1[0] - p0[0]) / dt, (p1[1] - p0[1]) / dt};
}

double Converter::visibility_of(const json& a) const {
  // nuScenes' visibility levels are bins of the fraction visible in the 6 images (1: 0-40 %,
  // 2: 40-60 %, 3: 60-80 %, 4: 80-100 %); a box is stored at its bin's middle. A box with no
  // lidar or radar point is 0 (the detection benchmark drops those from its ground truth).
  const auto l = a.find("num_lidar_pts"), r = a.find("num_radar_pts");
  if (l != a.end() && r != a.end() && l->is_number() && r->is_number() &&
      l->get<double>() + r->get<double>() <= 0)
    return 0.0;
  const auto v = a.find("visibility_token");
  if (v == a.end() || !v->is_string() || v->get<std::string>().empty()) return 1.0;
  static const std::map<std::string, double> kMid = {
      {"1", 0.2}, {"2", 0.5}, {"3", 0.7}, {"4", 0.9}};
  const auto it = kMid.find(v->get<std::string>());
  return it == kMid.end() ? 1.0 : it->second;
}

std::vector<uint8_t> Converter::read_image(const json& sd, const std::string& what) const {
  // Lexical (table_path): the file is the dataroot joined with a relative path without '..'.
  const std::string path = join_path(o.dataroot, table_path(sample_data, sd, "filename"));
  std::ifstream f(path, std::ios::binary);
  if (!f)
    throw_error<DataError>("nuScenes: {}: image '{}' is missing", what, core::clip(path, 300));
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.empty())
    throw_error<DataError>("nuScenes: {}: image '{}' is empty", what, core::clip(path, 300));
  return bytes;
}

const json& Converter::camera_data(const std::string& token, const std::string& ch) const {
  const auto kf = keyframes.find(token);
  if (kf != keyframes.end()) {
    const auto it = kf->second.find(ch);
    if (it != kf->second.end()) return *it->second;
  }
  throw_error<DataError>(
      "nuScenes: sample '{}' has no keyframe sample_data for camera {} (in '{}')",
      core::clip(token), core::clip(ch), sample_data.file);
}

void Converter::add_camera(SceneRecord& r, int64_t c, const json& sd,
                           const geom::Pose& global_to_ref, const std::string& token) const {
  const std::string& ch = o.cameras[static_cast<size_t>(c)];
  const std::string what =
      fmt::format("sample '{}' camera {} (sample_data '{}')", core::clip(token), core::clip(ch),
                  core::clip(str(sample_data, sd, "token")));
  const json& cs =
      calibrated_sensor.at(str(sample_data, sd, "calibrated_sensor_token"), where(sample_data, sd));
  const json& ep = ego_pose.at(str(sample_data, sd, "ego_pose_token"), where(sample_data, sd));
  // camera -> ego at the camera's time -> global -> the reference ego frame.
  geom::Pose cam_to_ref =
      compose(global_to_ref, compose(pose_of(ego_pose, ep), pose_of(calibrated_sensor, cs)));
  cam_to_ref.t = cam_to_ref.t - geom::Vec3{o.ego_x_offset, 0, 0};
  const std::array<double, 9> k = intrinsic_of(calibrated_sensor, cs);
  std::vector<uint8_t> bytes = read_image(sd, what);
  const std::string ctx =
      fmt::format("nuScenes: {}: image '{}'", what,
                  core::clip(join_path(o.dataroot, str(sample_data, sd, "filename")), 300));
  const JpegSize js = jpeg_size(bytes.data(), bytes.size(), ctx);
  if (js.height != stored_h || js.width != stored_w) {
    throw_error<DataError>("{} is {} x {}, the first camera's {} x {}", ctx, js.height, js.width,
                           stored_h, stored_w);
  }
  // The scale from the stored image to the written one, per axis (exact: pixel edges map to
  // pixel edges, docs/data.md's convention), applied to the intrinsics' first two rows.
  const double sx = static_cast<double>(width) / static_cast<double>(stored_w);
  const double sy = static_cast<double>(height) / static_cast<double>(stored_h);
  if (passthrough) {
    // Decoded at 1/8 (cheap) to find a corrupt or truncated file now, not at training.
    decode_jpeg(bytes.data(), bytes.size(), 8, ctx);
    r.jpeg.push_back(std::move(bytes));
  } else {
    int scale = 8;
    while (scale > 1 &&
           ((stored_h + scale - 1) / scale < height || (stored_w + scale - 1) / scale < width))
      scale /= 2;
    at::Tensor img = decode_jpeg(bytes.data(), bytes.size(), scale, ctx);
    if (img.size(0) != height || img.size(1) != width) {
      // The decoded grid's pixel covers `scale` stored pixels; the resize maps stored
      // coordinates u to sx u, so from the decoded grid by sx * scale.
      at::Tensor f = img.permute({2, 0, 1}).unsqueeze(0).to(at::kFloat);
      f = at::_upsample_bilinear2d_aa(f, {height, width}, false, sy * scale, sx * scale);
      img = f.squeeze(0).permute({1, 2, 0}).round().clamp(0, 255).to(at::kByte);
    }
    r.images[c].copy_(img);
  }
  float* K = r.intrinsics.data_ptr<float>() + c * 9;
  for (int j = 0; j < 3; ++j) {
    K[j] = static_cast<float>(k[j] * sx);  // |k| <= FLT_MAX (intrinsic_of) and sx, sy <= 1
    K[3 + j] = static_cast<float>(k[3 + j] * sy);
    K[6 + j] = static_cast<float>(k[6 + j]);
  }
  // The extrinsic's translation moves through two poses in double: inputs finite in float32 can
  // still leave it (its rotation is orthonormal).
  for (double v : {cam_to_ref.t.x, cam_to_ref.t.y, cam_to_ref.t.z}) {
    to_f32(v, calibrated_sensor, cs,
           fmt::format("translation (with ego_pose '{}', in the reference frame)",
                       core::clip(str(ego_pose, ep, "token"))));
  }
  const at::Tensor T = geom::pose_tensor(cam_to_ref);
  std::copy_n(T.data_ptr<float>(), 16, r.cam_to_ego.data_ptr<float>() + c * 16);
}

void Converter::add_boxes(SceneRecord& r, const std::string& token, const geom::Pose& global_to_ref,
                          std::map<std::string, int64_t>& skipped) const {
  std::vector<float> rows, vel;
  const geom::Vec3 shift{o.ego_x_offset, 0, 0};
  const auto a_it = anns.find(token);
  if (a_it != anns.end()) {
    for (const json* ap : a_it->second) {
      const json& a = *ap;
      const json& inst = instance.at(str(annotation, a, "instance_token"), where(annotation, a));
      const json& cat = category.at(str(instance, inst, "category_token"), where(instance, inst));
      const std::string cname = str(category, cat, "name");
      const auto cls = category_class.find(cname);
      if (cls == category_class.end()) {
        ++skipped[cname];
        continue;
      }
      const geom::Pose box = pose_of(annotation, a);
      const auto size = nums(annotation, a, "size", 3);  // w, l, h
      const geom::Vec3 c = global_to_ref.apply(box.t) - shift;
      const geom::Mat3 rot = global_to_ref.R * box.R;
      const double yaw = std::atan2(rot.m[1][0], rot.m[0][0]);
      const auto v = velocity(a);
      const geom::Vec3 vr = global_to_ref.R * geom::Vec3{v[0], v[1], 0};
      const std::string in_ego = "translation (in the sample's ego frame)";
      rows.insert(
          rows.end(),
          {to_f32(c.x, annotation, a, in_ego), to_f32(c.y, annotation, a, in_ego),
           to_f32(c.z, annotation, a, in_ego), static_cast<float>(size[1]),
           static_cast<float>(size[0]), static_cast<float>(size[2]), static_cast<float>(yaw),
           static_cast<float>(class_index.at(cls->second)), static_cast<float>(visibility_of(a))});
      // NaN is the stored "no velocity"; a computed one must be finite in float32.
      const std::string vel_what = "velocity (from its prev/next annotations)";
      vel.insert(
          vel.end(),
          {std::isnan(v[0]) ? static_cast<float>(v[0]) : to_f32(vr.x, annotation, a, vel_what),
           std::isnan(v[1]) ? static_cast<float>(v[1]) : to_f32(vr.y, annotation, a, vel_what)});
    }
  }
  const auto k = static_cast<int64_t>(rows.size() / kBoxColumns);
  r.boxes = at::empty({k, kBoxColumns}, at::kFloat);
  std::copy(rows.begin(), rows.end(), r.boxes.data_ptr<float>());
  r.velocities = at::empty({k, 2}, at::kFloat);
  std::copy(vel.begin(), vel.end(), r.velocities.data_ptr<float>());
}

SceneRecord Converter::make(const Job& job) {
  const json& s = *job.sample;
  const std::string token = str(sample, s, "token");
  std::vector<const json*> cams;
  for (const auto& ch : o.cameras) cams.push_back(&camera_data(token, ch));
  const auto kf = keyframes.find(token);
  const auto lidar = kf->second.find("LIDAR_TOP");
  const json& ref_sd = lidar != kf->second.end() ? *lidar->second : *cams.front();
  const geom::Pose ref = pose_of(ego_pose, ego_pose.at(str(sample_data, ref_sd, "ego_pose_token"),
                                                       where(sample_data, ref_sd)));
  const geom::Pose global_to_ref = inverse(ref);

  SceneRecord r;
  r.sample_token = token;
  {
    // The stored ego frame in the global frame: the reference pose after the origin shift.
    geom::Pose e = ref;
    e.t = ref.apply({o.ego_x_offset, 0, 0});
    r.ego_to_global = at::eye(4, at::kDouble);
    double* T = r.ego_to_global.data_ptr<double>();
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 3; ++j) T[i * 4 + j] = e.R.m[i][j];
    }
    T[3] = e.t.x, T[7] = e.t.y, T[11] = e.t.z;
  }
  const auto n = static_cast<int64_t>(o.cameras.size());
  r.intrinsics = at::empty({n, 3, 3}, at::kFloat);
  r.cam_to_ego = at::empty({n, 4, 4}, at::kFloat);
  if (!passthrough) r.images = at::empty({n, height, width, 3}, at::kByte);
  for (int64_t c = 0; c < n; ++c)
    add_camera(r, c, *cams[static_cast<size_t>(c)], global_to_ref, token);

  // Boxes: global -> the reference ego frame.
  std::map<std::string, int64_t> skipped;
  add_boxes(r, token, global_to_ref, skipped);
  r.bev_semantics = at::zeros({o.bev.x_cells(), o.bev.y_cells()}, at::kByte);
  if (const NuMap* map = map_of(s)) paint_map(*map, ref, o.bev, o.ego_x_offset, r.bev_semantics);
  rasterise(r.boxes, r.bev_semantics);
  {
    std::lock_guard<std::mutex> lock(m);
    for (const auto& [name, count] : skipped) ignored[name] += count;
    boxes += r.boxes.size(0);
  }
  return r;
}

// BEV labels from the boxes' footprints (docs/data.md's rule for objects), over the map layers:
// a cell takes the class (index + object_offset) of a box whose footprint holds the cell's
// centre or that holds the box's centre.
void Converter::rasterise(const at::Tensor& boxes, at::Tensor& bev) const {
  const BevGrid& g = o.bev;
  const int64_t X = g.x_cells(), Y = g.y_cells();
  uint8_t* p = bev.data_ptr<uint8_t>();
  const float* b = boxes.data_ptr<float>();
  for (int64_t i = 0; i < boxes.size(0); ++i) {
    const float* row = b + i * kBoxColumns;
    geom::Box box;
    box.x = row[kBoxX], box.y = row[kBoxY], box.z = row[kBoxZ];
    box.l = row[kBoxL], box.w = row[kBoxW], box.h = row[kBoxH], box.yaw = row[kBoxYaw];
    const auto cls = static_cast<uint8_t>(row[kBoxClass] + object_offset);
    const double reach = 0.5 * std::hypot(box.l, box.w);
    const auto lo_x = std::max<int64_t>(
        0, static_cast<int64_t>(std::floor((box.x - reach - g.x_min) / g.resolution)));
    const auto hi_x = std::min<int64_t>(
        X - 1, static_cast<int64_t>(std::floor((box.x + reach - g.x_min) / g.resolution)));
    const auto lo_y = std::max<int64_t>(
        0, static_cast<int64_t>(std::floor((box.y - reach - g.y_min) / g.resolution)));
    const auto hi_y = std::min<int64_t>(
        Y - 1, static_cast<int64_t>(std::floor((box.y + reach - g.y_min) / g.resolution)));
    for (int64_t ix = lo_x; ix <= hi_x; ++ix) {
      for (int64_t iy = lo_y; iy <= hi_y; ++iy) {
        const double cx = g.x_min + (static_cast<double>(ix) + 0.5) * g.resolution;
        const double cy = g.y_min + (static_cast<double>(iy) + 0.5) * g.resolution;
        if (box.footprint_contains(cx, cy)) p[ix * Y + iy] = cls;
      }
    }
    const double fx = std::floor((box.x - g.x_min) / g.resolution);
    const double fy = std::floor((box.y - g.y_min) / g.resolution);
    if (fx >= 0 && fy >= 0 && fx < static_cast<double>(X) && fy < static_cast<double>(Y))
      p[static_cast<int64_t>(fx) * Y + static_cast<int64_t>(fy)] = cls;
  }
}

}  // namespace parallax::data::nusc

#endif  // PARALLAX_WITH_NUSCENES
