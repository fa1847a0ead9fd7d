#include "data/shard.h"

#include "core/error.h"
#include "data/jpeg.h"
#include "data/shard_sequence.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <tuple>

namespace fs = std::filesystem;

namespace parallax::data {
namespace {

bool parse_scene_name(const std::string& s, int64_t& out) {
  if (s.empty() || s.size() > 12) return false;
  for (char c : s) {
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  }
  out = std::stoll(s);
  return true;
}

at::ScalarType dtype_of(const std::string& name) {
  return (name == "images" || name == "bev_semantics") ? at::kByte : at::kFloat;
}

// Rank and fixed trailing dimensions every scene has, with or without dataset.json.
void check_basic_shape(const std::string& name, const h5::DatasetShape& s,
                       const std::string& where) {
  const std::map<std::string, std::vector<int64_t>> kBasic = {{"images", {-1, -1, -1, 3}},
                                                              {"intrinsics", {-1, 3, 3}},
                                                              {"cam_to_ego", {-1, 4, 4}},
                                                              {"bev_semantics", {-1, -1}},
                                                              {"boxes", {-1, kBoxColumns}}};
  const auto& want = kBasic.at(name);
  bool ok = s.dims.size() == want.size();
  for (size_t d = 0; ok && d < want.size(); ++d) ok = want[d] < 0 || s.dims[d] == want[d];
  if (!ok) {
    std::vector<std::string> w;
    for (int64_t v : want) w.push_back(v < 0 ? "*" : std::to_string(v));
    throw_error<DataError>("{}: dataset '{}' has shape [{}], expected [{}]", where, name,
                           fmt::join(s.dims, ", "), fmt::join(w, ", "));
  }
}

void check_type(const std::string& name, const h5::DatasetShape& s, const std::string& where) {
  const bool want_int = dtype_of(name) == at::kByte;
  const bool ok = want_int ? (s.type_class == H5T_INTEGER)
                           : (s.type_class == H5T_FLOAT || s.type_class == H5T_INTEGER);
  if (!ok) {
    throw_error<DataError>("{}: dataset '{}' has type {}, expected {}", where, name, s.describe(),
                           want_int ? "uint8" : "float32");
  }
}

// A scene's cameras as JPEG bytes (ShardWriter with a JPEG quality): the bytes of camera c are
// bytes[offsets[c], offsets[c + 1]).
constexpr const char* kJpegBytes = "images_jpeg";
constexpr const char* kJpegOffsets = "images_jpeg_offsets";
// Optional per scene (a converted dataset): box velocities and the source's sample id.
constexpr const char* kVelocities = "velocities";
constexpr const char* kSampleToken = "sample_token";
constexpr const char* kEgoToGlobal = "ego_to_global";

struct JpegImages {
  at::Tensor bytes;    // uint8 [total]
  at::Tensor offsets;  // int64 [N + 1]
  int64_t height = 0, width = 0;
};

bool stores_jpeg(hid_t group) {
  return !h5::link_exists(group, "images") && h5::link_exists(group, kJpegBytes);
}

// The stored image size of a JPEG scene (its group's attributes), checked.
std::pair<int64_t, int64_t> jpeg_image_size(hid_t group, const std::string& w) {
  const auto h = h5::read_int_attribute(group, "image_height", w);
  const auto wd = h5::read_int_attribute(group, "image_width", w);
  if (!h || !wd || *h < 1 || *wd < 1) {
    throw_error<DataError>(
        "{}: JPEG images without valid 'image_height'/'image_width' attributes on the scene group",
        w);
  }
  return {*h, *wd};
}

// Reads (under the caller's HDF5 lock) the bytes and offsets; decoding happens outside it.
JpegImages read_jpeg_bytes(hid_t group, const std::string& w) {
  JpegImages j;
  std::tie(j.height, j.width) = jpeg_image_size(group, w);
  if (!h5::link_exists(group, kJpegOffsets))
    throw_error<DataError>("{}: dataset '{}' is missing", w, kJpegOffsets);
  for (const char* name : {kJpegBytes, kJpegOffsets}) {
    const std::string ctx = fmt::format("{}: dataset '{}'", w, name);
    h5::Id ds(H5Dopen2(group, name, H5P_DEFAULT), ctx + ": cannot open");
    const h5::DatasetShape shape = h5::dataset_shape(ds, ctx);
    if (shape.dims.size() != 1 || shape.type_class != H5T_INTEGER)
      throw_error<DataError>("{} is {}, expected a 1-D integer dataset", ctx, shape.describe());
    const bool is_bytes = std::string(name) == kJpegBytes;
    at::Tensor t = h5::read_tensor(ds, shape, is_bytes ? at::kByte : at::kLong,
                                   ctx + ": cannot read (corrupt shard?)");
    (is_bytes ? j.bytes : j.offsets) = std::move(t);
  }
  const int64_t n = j.offsets.numel() - 1;
  const int64_t* o = j.offsets.data_ptr<int64_t>();
  bool ok = n >= 1 && o[0] == 0 && o[n] == j.bytes.numel();
  for (int64_t c = 0; ok && c < n; ++c) ok = o[c] < o[c + 1];
  if (!ok) {
    throw_error<DataError>("{}: '{}' [{}] does not cut the {} bytes of '{}' into cameras", w,
                           kJpegOffsets, fmt::join(j.offsets.sizes(), ", "), j.bytes.numel(),
                           kJpegBytes);
  }
  return j;
}

// Every camera decoded at full size straight into the scene's tensor, each checked against the
// stored size by the decoder: uint8 [N, H, W, 3].
// `cameras` (indices; empty: all) decoded at 1/`scale` into uint8 [n, ceil(H/s), ceil(W/s), 3].
at::Tensor decode_cameras(const JpegImages& j, const std::string& w,
                          const std::vector<int64_t>& cameras = {}, int scale = 1) {
  const int64_t all = j.offsets.numel() - 1;
  std::vector<int64_t> cams = cameras;
  if (cams.empty()) {
    for (int64_t c = 0; c < all; ++c) cams.push_back(c);
  }
  const int64_t* o = j.offsets.data_ptr<int64_t>();
  const int64_t h = (j.height + scale - 1) / scale, wd = (j.width + scale - 1) / scale;
  at::Tensor out = at::empty({static_cast<int64_t>(cams.size()), h, wd, 3}, at::kByte);
  for (size_t i = 0; i < cams.size(); ++i) {
    const int64_t c = cams[i];
    at::Tensor camera = out[static_cast<int64_t>(i)];
    decode_jpeg(j.bytes.data_ptr<uint8_t>() + o[c], static_cast<std::size_t>(o[c + 1] - o[c]),
                scale, fmt::format("{} camera {}", w, c), &camera);
  }
  return out;
}

// Narrows `rec` to a selection of cameras at a decode scale (outside the HDF5 lock): the other
// cameras are never decoded; the intrinsics follow the scale exactly. Checks the result against
// `info` with the selection's cameras and image size.
void apply_selection(SceneRecord& rec, const std::optional<JpegImages>& jpeg,
                     const DatasetInfo& info, const ShardReader::Selection& sel,
                     const std::string& w) {
  const int64_t stored = rec.intrinsics.size(0);
  std::vector<int64_t> cams = sel.cameras;
  if (cams.empty()) {
    for (int64_t c = 0; c < stored; ++c) cams.push_back(c);
  }
  for (int64_t c : cams) {
    if (c < 0 || c >= stored)
      throw_error<DataError>("{}: camera {} selected, the scene has {} (data.cameras)", w, c,
                             stored);
  }
  const int s = sel.decode_scale;
  if (s != 1 && s != 2 && s != 4 && s != 8)
    throw_error<DataError>("{}: decode scale 1/{} (1, 2, 4 or 8)", w, s);
  if (!jpeg && s != 1)
    throw_error<DataError>("{}: raw images are read at full size (decode scale 1/{})", w, s);
  const at::Tensor idx = at::tensor(cams, at::kLong);
  if (jpeg) {
    rec.images = decode_cameras(*jpeg, w, cams, s);
  } else {
    rec.images = rec.images.index_select(0, idx);
  }
  rec.intrinsics = rec.intrinsics.index_select(0, idx).contiguous();
  rec.cam_to_ego = rec.cam_to_ego.index_select(0, idx).contiguous();
  if (s != 1) {
    float* K = rec.intrinsics.data_ptr<float>();
    for (int64_t c = 0; c < rec.intrinsics.size(0); ++c) {
      for (int e = 0; e < 6; ++e) K[c * 9 + e] /= static_cast<float>(s);  // exact: s = 2^k
    }
  }
  DatasetInfo seen = info;
  seen.cameras = static_cast<int64_t>(cams.size());
  seen.image_height = rec.images.size(1);
  seen.image_width = rec.images.size(2);
  check_scene(rec, seen, w);
}

// The optional per-box velocities of a scene (nuScenes conversions): float [K, 2], K = the boxes'.
void read_velocities(hid_t group, SceneRecord& rec, const std::string& w) {
  if (!h5::link_exists(group, kVelocities)) return;
  const std::string ctx = fmt::format("{}: dataset '{}'", w, kVelocities);
  h5::Id ds(H5Dopen2(group, kVelocities, H5P_DEFAULT), ctx + ": cannot open");
  const h5::DatasetShape shape = h5::dataset_shape(ds, ctx);
  if (shape.type_class != H5T_FLOAT || shape.dims.size() != 2 || shape.dims[1] != 2 ||
      shape.dims[0] != rec.boxes.size(0)) {
    throw_error<DataError>("{} is {}, expected float [{}, 2] (one row per box)", ctx,
                           shape.describe(), rec.boxes.size(0));
  }
  rec.velocities = h5::read_tensor(ds, shape, at::kFloat, ctx + ": cannot read (corrupt shard?)");
  // NaN means "unknown" (docs/data.md); an infinity is a broken file.
  if (rec.velocities.isinf().any().item<bool>())
    throw_error<DataError>("{} holds infinite values (NaN marks an unknown velocity)", ctx);
}

// The optional ego pose (float64 [4, 4], finite); undefined when the scene has none.
at::Tensor read_ego_to_global(hid_t group, const std::string& w) {
  if (!h5::link_exists(group, kEgoToGlobal)) return {};
  const std::string ctx = fmt::format("{}: dataset '{}'", w, kEgoToGlobal);
  h5::Id ds(H5Dopen2(group, kEgoToGlobal, H5P_DEFAULT), ctx + ": cannot open");
  const h5::DatasetShape shape = h5::dataset_shape(ds, ctx);
  if (shape.type_class != H5T_FLOAT || shape.dims != std::vector<int64_t>{4, 4})
    throw_error<DataError>("{} is {}, expected float [4, 4]", ctx, shape.describe());
  at::Tensor t = h5::read_tensor(ds, shape, at::kDouble, ctx + ": cannot read (corrupt shard?)");
  if (!t.isfinite().all().item<bool>())
    throw_error<DataError>("{} holds NaN or infinite values", ctx);
  return t;
}

}  // namespace

ShardReader::ShardReader(std::string path) : path_(std::move(path)) {
  std::error_code ec;
  if (!fs::exists(path_, ec)) throw_error<DataError>("shard '{}' not found", path_);
  h5::Hdf5Lock lock;
  file_ = h5::Id(H5Fopen(path_.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT),
                 fmt::format("cannot open shard '{}' (truncated or not an HDF5 file?)", path_));
  const std::string ctx = fmt::format("shard '{}'", path_);
  const auto version = h5::read_int_attribute(file_, "schema_version", ctx);
  if (!version)
    throw_error<DataError>(
        "shard '{}' has no 'schema_version' attribute: not a Parallax data shard", path_);
  if (*version != kSchemaVersion) {
    throw_error<DataError>("shard '{}' has schema_version {}; this build reads version {}", path_,
                           *version, kSchemaVersion);
  }
  if (!h5::link_exists(file_, "scenes"))
    throw_error<DataError>("shard '{}' has no /scenes group", path_);
  h5::Id scenes(H5Gopen2(file_, "scenes", H5P_DEFAULT), ctx + ": cannot open /scenes");
  for (const auto& name : h5::list_links(scenes, ctx + ": cannot list /scenes")) {
    int64_t idx = 0;
    if (!parse_scene_name(name, idx)) {
      throw_error<DataError>("shard '{}': '/scenes/{}' is not a scene index (expected 6 digits)",
                             path_, name);
    }
    indices_.push_back(idx);
  }
  std::sort(indices_.begin(), indices_.end());
}

bool ShardReader::has_scene(int64_t index) const {
  return std::binary_search(indices_.begin(), indices_.end(), index);
}

std::string ShardReader::where(int64_t index) const {
  return fmt::format("'{}' scene {}", path_, scene_name(index));
}

std::map<std::string, h5::DatasetShape> ShardReader::shapes(int64_t index) const {
  const std::string w = where(index);
  if (!has_scene(index)) throw_error<DataError>("{}: no such scene in this shard", w);
  std::map<std::string, h5::DatasetShape> out;
  h5::Hdf5Lock lock;
  h5::Id group(H5Gopen2(file_, ("scenes/" + scene_name(index)).c_str(), H5P_DEFAULT),
               w + ": cannot open group");
  const bool jpeg = stores_jpeg(group);
  for (const auto& name : scene_dataset_names()) {
    if (jpeg && name == "images") {
      // The decoded shape: cameras from the offsets, the size from the group's attributes.
      const auto [h, wd] = jpeg_image_size(group, w);
      if (!h5::link_exists(group, kJpegOffsets))
        throw_error<DataError>("{}: dataset '{}' is missing", w, kJpegOffsets);
      h5::Id ds(H5Dopen2(group, kJpegOffsets, H5P_DEFAULT),
                fmt::format("{}: cannot open dataset '{}'", w, kJpegOffsets));
      const auto offsets = h5::dataset_shape(ds, fmt::format("{}: dataset '{}'", w, kJpegOffsets));
      h5::DatasetShape s;
      s.dims = {offsets.dims.empty() ? 0 : offsets.dims[0] - 1, h, wd, 3};
      s.type_class = H5T_INTEGER;
      s.type_size = 1;
      out[name] = s;
      continue;
    }
    if (!h5::link_exists(group, name))
      throw_error<DataError>("{}: dataset '{}' is missing", w, name);
    h5::Id ds(H5Dopen2(group, name.c_str(), H5P_DEFAULT),
              fmt::format("{}: cannot open dataset '{}'", w, name));
    out[name] = h5::dataset_shape(ds, fmt::format("{}: dataset '{}'", w, name));
  }
  return out;
}

SceneRecord ShardReader::read(int64_t index, const DatasetInfo* info) const {
  return read_impl(index, info, nullptr);
}

SceneRecord ShardReader::read(int64_t index, const DatasetInfo& info, const Selection& sel) const {
  return read_impl(index, &info, &sel);
}

SceneRecord ShardReader::read_impl(int64_t index, const DatasetInfo* info,
                                   const Selection* sel) const {
  const std::string w = where(index);
  if (!has_scene(index)) throw_error<DataError>("{}: no such scene in this shard", w);
  SceneRecord rec;
  rec.index = index;
  std::optional<JpegImages> jpeg;
  {
    h5::Hdf5Lock lock;
    h5::Id group(H5Gopen2(file_, ("scenes/" + scene_name(index)).c_str(), H5P_DEFAULT),
                 w + ": cannot open group");
    for (const auto& name : scene_dataset_names()) {
      if (name == "images" && stores_jpeg(group)) {
        jpeg = read_jpeg_bytes(group, w);
        if (info && (jpeg->offsets.numel() - 1 != info->cameras ||
                     jpeg->height != info->image_height || jpeg->width != info->image_width)) {
          throw_error<DataError>(
              "{}: {} JPEG images of {} x {}, expected {} of {} x {} (from dataset.json)", w,
              jpeg->offsets.numel() - 1, jpeg->height, jpeg->width, info->cameras,
              info->image_height, info->image_width);
        }
        continue;
      }
      if (!h5::link_exists(group, name))
        throw_error<DataError>("{}: dataset '{}' is missing", w, name);
      const std::string ctx = fmt::format("{}: dataset '{}'", w, name);
      h5::Id ds(H5Dopen2(group, name.c_str(), H5P_DEFAULT), ctx + ": cannot open");
      const h5::DatasetShape shape = h5::dataset_shape(ds, ctx);
      check_type(name, shape, w);
      check_basic_shape(name, shape, w);
      if (info) {
        // Check before reading, so a wrong file never makes us allocate or read garbage sizes.
        const auto want = expected_shape(*info, name);
        bool ok = true;
        for (size_t d = 0; d < want.size(); ++d)
          ok = ok && (want[d] < 0 || shape.dims[d] == want[d]);
        if (!ok) {
          std::vector<std::string> ws;
          for (int64_t v : want) ws.push_back(v < 0 ? "K" : std::to_string(v));
          throw_error<DataError>(
              "{}: dataset '{}' has shape [{}], expected [{}] (from dataset.json)", w, name,
              fmt::join(shape.dims, ", "), fmt::join(ws, ", "));
        }
      }
      at::Tensor t =
          h5::read_tensor(ds, shape, dtype_of(name), ctx + ": cannot read (corrupt shard?)");
      if (name == "images")
        rec.images = std::move(t);
      else if (name == "intrinsics")
        rec.intrinsics = std::move(t);
      else if (name == "cam_to_ego")
        rec.cam_to_ego = std::move(t);
      else if (name == "bev_semantics")
        rec.bev_semantics = std::move(t);
      else
        rec.boxes = std::move(t);
    }
    if (auto token = h5::read_string_attribute(group, kSampleToken, w)) rec.sample_token = *token;
    read_velocities(group, rec, w);
    rec.ego_to_global = read_ego_to_global(group, w);
    read_sequence_fields(group, rec, w);
  }
  if (sel) {
    apply_selection(rec, jpeg, *info, *sel, w);
    return rec;
  }
  if (jpeg) rec.images = decode_cameras(*jpeg, w);  // outside the HDF5 lock
  if (info) {
    check_scene(rec, *info, w);
  } else {
    if (rec.intrinsics.size(0) != rec.images.size(0) ||
        rec.cam_to_ego.size(0) != rec.images.size(0)) {
      throw_error<DataError>(
          "{}: images, intrinsics and cam_to_ego disagree on the number of cameras ({}, {}, {})", w,
          rec.images.size(0), rec.intrinsics.size(0), rec.cam_to_ego.size(0));
    }
  }
  return rec;
}

SampleMeta ShardReader::sample_meta(int64_t index) const {
  const std::string w = where(index);
  if (!has_scene(index)) throw_error<DataError>("{}: no such scene in this shard", w);
  h5::Hdf5Lock lock;
  h5::Id group(H5Gopen2(file_, ("scenes/" + scene_name(index)).c_str(), H5P_DEFAULT),
               w + ": cannot open group");
  SampleMeta m;
  m.token = h5::read_string_attribute(group, kSampleToken, w).value_or("");
  m.ego_to_global = read_ego_to_global(group, w);
  return m;
}

std::vector<int> ShardReader::visible_box_classes(int64_t index) const {
  const std::string w = where(index);
  if (!has_scene(index)) throw_error<DataError>("{}: no such scene in this shard", w);
  h5::Hdf5Lock lock;
  h5::Id group(H5Gopen2(file_, ("scenes/" + scene_name(index)).c_str(), H5P_DEFAULT),
               w + ": cannot open group");
  const std::string ctx = fmt::format("{}: dataset 'boxes'", w);
  if (!h5::link_exists(group, "boxes")) throw_error<DataError>("{}: dataset 'boxes' is missing", w);
  h5::Id ds(H5Dopen2(group, "boxes", H5P_DEFAULT), ctx + ": cannot open");
  const h5::DatasetShape shape = h5::dataset_shape(ds, ctx);
  check_type("boxes", shape, w);
  check_basic_shape("boxes", shape, w);
  const at::Tensor boxes =
      h5::read_tensor(ds, shape, at::kFloat, ctx + ": cannot read (corrupt shard?)").contiguous();
  std::vector<int> out;
  const float* b = boxes.data_ptr<float>();
  for (int64_t k = 0; k < boxes.size(0); ++k) {
    const float* r = b + k * kBoxColumns;
    if (r[kBoxVisibility] > 0 && std::isfinite(r[kBoxClass]))
      out.push_back(static_cast<int>(std::lround(r[kBoxClass])));
  }
  return out;
}

SequenceInfo ShardReader::sequence_info(int64_t index) const {
  const std::string w = where(index);
  if (!has_scene(index)) throw_error<DataError>("{}: no such scene in this shard", w);
  h5::Hdf5Lock lock;
  h5::Id group(H5Gopen2(file_, ("scenes/" + scene_name(index)).c_str(), H5P_DEFAULT),
               w + ": cannot open group");
  return read_sequence_info(group, index, w);
}

std::vector<SampleMeta> split_sample_meta(const DatasetInfo& info, const std::string& split) {
  const SplitInfo& si = info.split(split);
  std::vector<SampleMeta> out;
  for (const auto& shard : si.shards) {
    const ShardReader r(join_path(info.dir, shard));
    for (int64_t idx : r.scene_indices()) {
      if (idx < 0 || idx >= si.scenes)
        throw_error<DataError>("{}: scene index outside the split's {} scenes", r.where(idx),
                               si.scenes);
      if (static_cast<int64_t>(out.size()) <= idx) out.resize(static_cast<size_t>(idx) + 1);
      out[static_cast<size_t>(idx)] = r.sample_meta(idx);
    }
  }
  out.resize(static_cast<size_t>(si.scenes));
  return out;
}

bool is_data_shard(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char sig[8] = {};
  if (!f.read(sig, 8)) return false;
  // The HDF5 signature at offset 0 (files with a user block are not produced by Parallax).
  if (std::string(sig, 8) != std::string("\x89HDF\r\n\x1a\n", 8)) return false;
  h5::Hdf5Lock lock;
  const hid_t fid = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (fid < 0) {
    H5Eclear2(H5E_DEFAULT);
    return true;  // an HDF5 signature but unreadable: let the shard reader report why
  }
  h5::Id file(fid, "");
  return h5::link_exists(file, "scenes");
}

DatasetInfo infer_info(const ShardReader& shard) {
  DatasetInfo info;
  info.dir = fs::path(shard.path()).parent_path().string();
  info.generator = "(inferred from " + shard.path() + ")";
  if (shard.scene_indices().empty()) return info;
  const auto shapes = shard.shapes(shard.scene_indices().front());
  const auto& img = shapes.at("images").dims;
  const auto& bev = shapes.at("bev_semantics").dims;
  if (img.size() == 4) {
    info.cameras = img[0];
    info.image_height = img[1];
    info.image_width = img[2];
  }
  if (bev.size() == 2) {
    info.bev.x_min = -0.5 * info.bev.resolution * static_cast<double>(bev[0]);
    info.bev.x_max = -info.bev.x_min;
    info.bev.y_min = -0.5 * info.bev.resolution * static_cast<double>(bev[1]);
    info.bev.y_max = -info.bev.y_min;
  }
  return info;
}

ShardWriter::ShardWriter(std::string path, int deflate_level, int jpeg_quality)
    : path_(std::move(path)),
      tmp_path_(path_ + ".tmp"),
      deflate_level_(deflate_level),
      jpeg_quality_(jpeg_quality) {
  if (deflate_level_ < 0 || deflate_level_ > 9) {
    throw_error<DataError>("shard '{}': compression level {} is not in 0..9", path_,
                           deflate_level_);
  }
  if (jpeg_quality_ < 0 || jpeg_quality_ > 100) {
    throw_error<DataError>("shard '{}': JPEG quality {} is not in 1..100 (0: raw images)", path_,
                           jpeg_quality_);
  }
  h5::Hdf5Lock lock;
  file_ = h5::create_file(tmp_path_);
  const std::string ctx = fmt::format("shard '{}'", tmp_path_);
  h5::write_int_attribute(file_, "schema_version", kSchemaVersion, ctx);
  scenes_ = h5::create_group(file_, "scenes", ctx + ": cannot create /scenes");
}

ShardWriter::~ShardWriter() {
  if (!file_.valid()) return;
  h5::Hdf5Lock lock;
  scenes_.reset();
  file_.reset();
  std::error_code ec;
  fs::remove(tmp_path_, ec);
}

void ShardWriter::write(const SceneRecord& s) {
  const std::string ctx = fmt::format("shard '{}' scene {}", tmp_path_, scene_name(s.index));
  if (!file_.valid()) throw_error<DataError>("{}: the shard is already closed", ctx);
  const bool passthrough = !s.jpeg.empty();
  if (passthrough && jpeg_quality_ == 0)
    throw_error<DataError>("{}: JPEG bytes given to a shard that stores raw images", ctx);
  int64_t h = 0, w = 0;
  if (passthrough) {
    // Stored as they are: every camera must hold a JPEG of one size.
    for (size_t c = 0; c < s.jpeg.size(); ++c) {
      const JpegSize js =
          jpeg_size(s.jpeg[c].data(), s.jpeg[c].size(), fmt::format("{} camera {}", ctx, c));
      if (c > 0 && (js.height != h || js.width != w)) {
        throw_error<DataError>("{}: camera {} is a {} x {} JPEG, camera 0 {} x {}", ctx, c,
                               js.height, js.width, h, w);
      }
      h = js.height;
      w = js.width;
    }
  } else {
    h = s.images.size(1);
    w = s.images.size(2);
  }
  at::Tensor jpeg_bytes, jpeg_offsets;
  if (passthrough) {
    std::vector<int64_t> offsets{0};
    for (const auto& one : s.jpeg)
      offsets.push_back(offsets.back() + static_cast<int64_t>(one.size()));
    jpeg_bytes = at::empty({offsets.back()}, at::kByte);
    for (size_t c = 0; c < s.jpeg.size(); ++c)
      std::memcpy(jpeg_bytes.data_ptr<uint8_t>() + offsets[c], s.jpeg[c].data(), s.jpeg[c].size());
    jpeg_offsets = at::tensor(offsets, at::kLong);
  } else if (jpeg_quality_ > 0) {
    // Encoded before taking the HDF5 lock.
    std::vector<uint8_t> all;
    std::vector<int64_t> offsets{0};
    for (int64_t c = 0; c < s.images.size(0); ++c) {
      const std::vector<uint8_t> one =
          encode_jpeg(s.images[c], jpeg_quality_, fmt::format("{} camera {}", ctx, c));
      all.insert(all.end(), one.begin(), one.end());
      offsets.push_back(static_cast<int64_t>(all.size()));
    }
    jpeg_bytes = at::empty({static_cast<int64_t>(all.size())}, at::kByte);
    std::memcpy(jpeg_bytes.data_ptr<uint8_t>(), all.data(), all.size());
    jpeg_offsets = at::tensor(offsets, at::kLong);
  }
  h5::Hdf5Lock lock;
  h5::Id group = h5::create_group(scenes_, scene_name(s.index), ctx + ": cannot create group");
  if (jpeg_quality_ > 0) {
    h5::write_tensor(group, kJpegBytes, jpeg_bytes, {0, {}, true}, ctx);
    h5::write_tensor(group, kJpegOffsets, jpeg_offsets, {0, {}, true}, ctx);
    h5::write_int_attribute(group, "image_height", h, ctx);
    h5::write_int_attribute(group, "image_width", w, ctx);
  } else {
    h5::write_tensor(group, "images", s.images, {deflate_level_, {1, h, w, 3}, true}, ctx);
  }
  h5::write_tensor(group, "intrinsics", s.intrinsics, {0, {}, true}, ctx);
  h5::write_tensor(group, "cam_to_ego", s.cam_to_ego, {0, {}, true}, ctx);
  h5::write_tensor(group, "bev_semantics", s.bev_semantics, {deflate_level_, {}, true}, ctx);
  h5::write_tensor(group, "boxes", s.boxes, {0, {}, true}, ctx);
  if (s.velocities.defined())
    h5::write_tensor(group, kVelocities, s.velocities, {0, {}, true}, ctx);
  if (!s.sample_token.empty()) h5::write_string_attribute(group, kSampleToken, s.sample_token, ctx);
  if (s.ego_to_global.defined())
    h5::write_tensor(group, kEgoToGlobal, s.ego_to_global.contiguous(), {0, {}, true}, ctx);
  write_sequence_fields(group, s, ctx);
  ++written_;
}

void ShardWriter::close() {
  if (!file_.valid()) return;
  {
    h5::Hdf5Lock lock;
    scenes_.reset();
    h5::check(H5Fflush(file_, H5F_SCOPE_GLOBAL),
              fmt::format("cannot flush shard '{}' (disk full?)", tmp_path_));
    // Close explicitly to see the status (a failed final write is an error, not a silent loss).
    const hid_t id = file_.release();
    if (H5Fclose(id) < 0) h5::fail(fmt::format("cannot close shard '{}' (disk full?)", tmp_path_));
  }
  std::error_code ec;
  fs::rename(tmp_path_, path_, ec);
  if (ec) throw_error<IoError>("cannot rename '{}' to '{}': {}", tmp_path_, path_, ec.message());
}

}  // namespace parallax::data
