#include "data/loader.h"

#include "core/error.h"
#include "core/log.h"

#include <ATen/Context.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/inverse.h>
#include <ATen/ops/matmul.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <numeric>

namespace parallax::data {
namespace {

at::Tensor alloc(at::IntArrayRef sizes, at::ScalarType dtype, bool pin) {
  return at::empty(sizes, at::TensorOptions().dtype(dtype).pinned_memory(pin));
}

// Keeps at most `max` boxes, the most visible first (ties: the stored order), in stored order.
std::vector<int64_t> select_boxes(const at::Tensor& boxes, int64_t max) {
  const int64_t K = boxes.size(0);
  std::vector<int64_t> keep(static_cast<size_t>(K));
  std::iota(keep.begin(), keep.end(), 0);
  if (K <= max) return keep;
  const float* b = boxes.data_ptr<float>();
  std::stable_sort(keep.begin(), keep.end(), [&](int64_t a, int64_t c) {
    return b[a * kBoxColumns + kBoxVisibility] > b[c * kBoxColumns + kBoxVisibility];
  });
  keep.resize(static_cast<size_t>(max));
  std::sort(keep.begin(), keep.end());
  return keep;
}

}  // namespace

LoaderOptions LoaderOptions::from_config(const DataConfig& cfg, uint64_t seed, int rank, int world,
                                         bool training) {
  LoaderOptions o;
  o.batch_size = cfg.batch_size;
  o.num_workers = cfg.num_workers;
  o.prefetch = cfg.prefetch;
  o.pin_memory = cfg.pin_memory;
  o.max_boxes = cfg.max_boxes;
  o.frames = cfg.frames;
  o.seed = seed;
  o.rank = rank;
  o.world = world;
  if (training) {
    o.shuffle = cfg.shuffle;
    o.class_balanced = cfg.sampler == "cbgs";
    o.drop_last = cfg.drop_last;
    o.repeat = true;
    o.augment = cfg.augment;
  } else {
    o.shuffle = false;
    o.drop_last = false;
    o.repeat = false;
    o.augment = false;
  }
  if (cfg.aug.resize.size() != 2 || cfg.aug.resize[0] > cfg.aug.resize[1]) {
    throw_error<ConfigError>("key 'data.aug.resize' must be [min, max] with min <= max, got [{}]",
                             fmt::join(cfg.aug.resize, ", "));
  }
  o.aug.photometric = cfg.aug.photometric;
  o.aug.brightness = cfg.aug.brightness;
  o.aug.contrast = cfg.aug.contrast;
  o.aug.saturation = cfg.aug.saturation;
  o.aug.hue_deg = cfg.aug.hue_deg;
  o.aug.geometric = cfg.aug.geometric;
  o.aug.resize_min = cfg.aug.resize[0];
  o.aug.resize_max = cfg.aug.resize[1];
  o.aug.rotate_deg = cfg.aug.rotate_deg;
  o.aug.flip_y = cfg.aug.flip_y;
  if (!cfg.image_size.empty()) {
    if (cfg.image_size.size() != 2 || cfg.image_size[0] < 8 || cfg.image_size[0] > 4096 ||
        cfg.image_size[1] < 8 || cfg.image_size[1] > 4096) {
      throw_error<ConfigError>(
          "key 'data.image_size' must be [H, W] with each in 8..4096, got [{}]",
          fmt::join(cfg.image_size, ", "));
    }
    o.image_height = cfg.image_size[0];
    o.image_width = cfg.image_size[1];
  }
  o.cameras = cfg.cameras;
  return o;
}

core::SceneSpec loader_scene_spec(const DatasetInfo& info, const DataConfig& cfg) {
  core::SceneSpec s = info.scene_spec(cfg.max_boxes);
  const LoaderOptions o = LoaderOptions::from_config(cfg, 0, 0, 1, false);
  std::vector<int64_t> seen;
  for (int64_t c : o.cameras) {
    if (c < 0 || c >= info.cameras || std::find(seen.begin(), seen.end(), c) != seen.end()) {
      throw_error<ConfigError>(
          "key 'data.cameras': [{}] must name distinct cameras in 0..{} (the dataset '{}' has {})",
          fmt::join(o.cameras, ", "), info.cameras - 1, info.dir, info.cameras);
    }
    seen.push_back(c);
  }
  if (!o.cameras.empty()) s.num_cameras = static_cast<int64_t>(o.cameras.size());
  if (o.image_height > 0) {
    s.image_height = o.image_height;
    s.image_width = o.image_width;
  }
  return s;
}

SceneRecord DataLoader::read_scene(int64_t index) const {
  SceneRecord rec = select_ ? dataset_->read(index, sel_) : dataset_->read(index);
  if (fit_) fit_images(rec, *fit_);
  return rec;
}

core::SceneSpec DataLoader::scene_spec() const {
  core::SceneSpec s = dataset_->info().scene_spec(opts_.max_boxes);
  s.num_cameras = out_cameras_;
  s.image_height = out_height_;
  s.image_width = out_width_;
  return s;
}

DistributedSampler make_sampler(const Dataset& dataset, const LoaderOptions& opts) {
  if (!opts.class_balanced)
    return DistributedSampler(dataset.size(), opts.rank, opts.world, opts.shuffle, opts.seed);
  std::vector<std::vector<int>> classes(static_cast<size_t>(dataset.size()));
  for (int64_t i = 0; i < dataset.size(); ++i)
    classes[static_cast<size_t>(i)] = dataset.shard_of(i).visible_box_classes(i);
  auto groups = std::make_shared<const CbgsGroups>(
      cbgs_groups(classes, static_cast<int>(dataset.info().box_classes.size())));
  return DistributedSampler(std::move(groups), opts.rank, opts.world, opts.seed);
}

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, LoaderOptions opts,
                       LoaderState start)
    : dataset_(std::move(dataset)),
      opts_(std::move(opts)),
      sampler_(make_sampler(*dataset_, opts_)) {
  const std::string what =
      fmt::format("loader for split '{}' of '{}' (rank {} of {})", dataset_->split(),
                  dataset_->info().dir, opts_.rank, opts_.world);
  if (opts_.batch_size < 1 || opts_.prefetch < 1 || opts_.num_workers < 0 || opts_.max_boxes < 1) {
    throw_error<DataError>(
        "{}: batch_size, prefetch and max_boxes must be >= 1 and num_workers >= 0", what);
  }
  batches_per_epoch_ = sampler_.num_batches(opts_.batch_size, opts_.drop_last);
  samples_per_epoch_ = sampler_.samples_used(opts_.batch_size, opts_.drop_last);
  if (opts_.repeat && batches_per_epoch_ == 0) {
    throw_error<DataError>(
        "{}: the split has {} scenes, not one full batch of {} per rank for {} ranks", what,
        dataset_->size(), opts_.batch_size, opts_.world);
  }
  const auto& g = dataset_->info().bev;
  if (opts_.augment && opts_.aug.geometric && opts_.aug.flip_y &&
      std::abs(g.y_min + g.y_max) > 1e-9) {
    throw_error<DataError>("{}: data.aug.flip_y needs a BEV grid symmetric in y, got y in [{}, {}]",
                           what, g.y_min, g.y_max);
  }
  if (start.epoch < 0 || start.position < 0 || start.position > samples_per_epoch_) {
    throw_error<DataError>(
        "{}: loader state (epoch {}, position {}) is outside an epoch of {} samples", what,
        start.epoch, start.position, samples_per_epoch_);
  }
  if (opts_.frames > 1 && dataset_->size() > 0) {
    // data.frames needs sequences: frames linked to their previous keyframe, with ego poses.
    const DatasetInfo& di = dataset_->info();
    if (!dataset_->sequence_info(0).in_sequence()) {
      throw_error<DataError>(
          "{}: data.frames = {} needs a dataset of sequences, and '{}' holds independent scenes "
          "(generate sequences with datagen --sequence-length, or convert nuScenes)",
          what, opts_.frames, di.dir);
    }
    if (di.sequence_length > 1 && opts_.frames > di.sequence_length) {
      throw_error<DataError>(
          "{}: data.frames = {} is longer than the dataset's sequences ({} frames, "
          "sequence_length in dataset.json)",
          what, opts_.frames, di.sequence_length);
    }
  }
  pin_ = opts_.pin_memory && at::hasCUDA();
  box_to_bev_ = box_to_bev_classes(dataset_->info());
  // The model's input: which cameras, what size, and how to get there from the stored images.
  const DatasetInfo& info = dataset_->info();
  for (size_t i = 0; i < opts_.cameras.size(); ++i) {
    const int64_t c = opts_.cameras[i];
    if (c < 0 || c >= info.cameras ||
        std::find(opts_.cameras.begin(), opts_.cameras.begin() + static_cast<std::ptrdiff_t>(i),
                  c) != opts_.cameras.begin() + static_cast<std::ptrdiff_t>(i)) {
      throw_error<DataError>("{}: data.cameras [{}] must name distinct cameras in 0..{}", what,
                             fmt::join(opts_.cameras, ", "), info.cameras - 1);
    }
  }
  out_cameras_ = opts_.cameras.empty() ? info.cameras : static_cast<int64_t>(opts_.cameras.size());
  out_height_ = opts_.image_height > 0 ? opts_.image_height : info.image_height;
  out_width_ = opts_.image_width > 0 ? opts_.image_width : info.image_width;
  if ((opts_.image_height > 0) != (opts_.image_width > 0))
    throw_error<DataError>("{}: the model's image size needs a height and a width", what);
  int scale = 1;
  if (info.image_codec == "jpeg") {
    for (int k : {8, 4, 2}) {
      if ((info.image_height + k - 1) / k >= out_height_ &&
          (info.image_width + k - 1) / k >= out_width_) {
        scale = k;
        break;
      }
    }
  }
  sel_.cameras = opts_.cameras;
  sel_.decode_scale = scale;
  select_ = !opts_.cameras.empty() || scale > 1;
  if (scale > 1 || out_height_ != info.image_height || out_width_ != info.image_width) {
    // From the decoded image (stored coordinates / scale) to the model's input.
    fit_ =
        ImageFit{out_height_, out_width_,
                 static_cast<double>(out_width_) * scale / static_cast<double>(info.image_width),
                 static_cast<double>(out_height_) * scale / static_cast<double>(info.image_height)};
  }
  cursor_ = start;
  consumed_ = start;
  end_epoch_ = opts_.repeat ? std::numeric_limits<int64_t>::max() : start.epoch + 1;
  for (int i = 0; i < opts_.num_workers; ++i) workers_.emplace_back([this] { worker(); });
}

DataLoader::~DataLoader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto& t : workers_) t.join();
}

std::optional<DataLoader::Plan> DataLoader::plan_next() {
  const int64_t B = opts_.batch_size;
  for (;;) {
    if (cursor_.epoch >= end_epoch_) return std::nullopt;
    const int64_t left = samples_per_epoch_ - cursor_.position;
    if (left <= 0 || (opts_.drop_last && left < B)) {
      cursor_ = {cursor_.epoch + 1, 0};
      continue;
    }
    if (cached_epoch_ != cursor_.epoch) {
      cached_indices_ = sampler_.indices(cursor_.epoch);
      cached_epoch_ = cursor_.epoch;
    }
    Plan p;
    p.epoch = cursor_.epoch;
    const int64_t take = std::min(B, left);
    const auto first = cached_indices_.begin() + cursor_.position;
    p.scenes.assign(first, first + take);
    cursor_.position += take;
    const int64_t rest = samples_per_epoch_ - cursor_.position;
    if (rest <= 0 || (opts_.drop_last && rest < B)) cursor_ = {cursor_.epoch + 1, 0};
    p.after = cursor_;
    return p;
  }
}

core::TensorDict DataLoader::build(const Plan& plan) const {
  const DatasetInfo& info = dataset_->info();
  const auto B = static_cast<int64_t>(plan.scenes.size());
  const int64_t N = out_cameras_, H = out_height_, W = out_width_;
  const int64_t X = info.bev.x_cells(), Y = info.bev.y_cells(), M = opts_.max_boxes;
  core::TensorDict out;
  at::Tensor images = alloc({B, N, H, W, 3}, at::kByte, pin_);
  at::Tensor intr = alloc({B, N, 3, 3}, at::kFloat, pin_);
  at::Tensor c2e = alloc({B, N, 4, 4}, at::kFloat, pin_);
  at::Tensor bev = alloc({B, X, Y}, at::kLong, pin_);
  at::Tensor boxes = alloc({B, M, kBoxColumns}, at::kFloat, pin_);
  // Each box's ground velocity (vx, vy) in the ego frame, row for row with `boxes`; NaN where
  // the dataset has none and on padding rows.
  at::Tensor vel = alloc({B, M, 2}, at::kFloat, pin_);
  at::Tensor index = alloc({B}, at::kLong, pin_);
  float* boxes_p = boxes.data_ptr<float>();
  float* vel_p = vel.data_ptr<float>();
  std::vector<SceneRecord> poses;  // the current frames' ego poses (data.frames > 1)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t scene = plan.scenes[static_cast<size_t>(b)];
    std::optional<AugmentParams> aug;
    if (opts_.augment) aug = draw_augment(opts_.aug, N, H, W, opts_.seed, plan.epoch, scene);
    SceneRecord rec = read_scene(scene, aug ? &*aug : nullptr);
    if (opts_.frames > 1) {
      SceneRecord p;
      p.index = rec.index;
      p.ego_to_global = rec.ego_to_global;
      poses.push_back(std::move(p));
    }
    std::memcpy(images.data_ptr<uint8_t>() + b * N * H * W * 3,
                rec.images.contiguous().data_ptr<uint8_t>(), static_cast<size_t>(N * H * W * 3));
    std::memcpy(intr.data_ptr<float>() + b * N * 9, rec.intrinsics.contiguous().data_ptr<float>(),
                static_cast<size_t>(N * 9) * 4);
    std::memcpy(c2e.data_ptr<float>() + b * N * 16, rec.cam_to_ego.contiguous().data_ptr<float>(),
                static_cast<size_t>(N * 16) * 4);
    const at::Tensor sem = rec.bev_semantics.contiguous();
    const uint8_t* s = sem.data_ptr<uint8_t>();
    int64_t* d = bev.data_ptr<int64_t>() + b * X * Y;
    for (int64_t i = 0; i < X * Y; ++i) d[i] = s[i];
    const at::Tensor bx = rec.boxes.contiguous();
    const auto keep = select_boxes(bx, M);
    if (static_cast<int64_t>(keep.size()) < bx.size(0)) {
      if (!warned_boxes_.exchange(true)) {
        core::log::warn(
            "{}: {} boxes, more than data.max_boxes = {}; keeping the most visible (warned once)",
            dataset_->shard_of(scene).where(scene), bx.size(0), M);
      }
    }
    float* rows = boxes_p + b * M * kBoxColumns;
    std::fill(rows, rows + M * kBoxColumns, 0.0f);
    for (int64_t k = 0; k < M; ++k) rows[k * kBoxColumns + kBoxClass] = -1.0f;
    for (size_t k = 0; k < keep.size(); ++k) {
      std::memcpy(rows + static_cast<int64_t>(k) * kBoxColumns,
                  bx.data_ptr<float>() + keep[k] * kBoxColumns, sizeof(float) * kBoxColumns);
    }
    float* v = vel_p + b * M * 2;
    std::fill(v, v + M * 2, std::numeric_limits<float>::quiet_NaN());
    if (rec.velocities.defined()) {
      const at::Tensor rv = rec.velocities.contiguous();
      for (size_t k = 0; k < keep.size(); ++k)
        std::memcpy(v + static_cast<int64_t>(k) * 2, rv.data_ptr<float>() + keep[k] * 2,
                    sizeof(float) * 2);
    }
    index.data_ptr<int64_t>()[b] = scene;
  }
  out.emplace("images", images);
  out.emplace("intrinsics", intr);
  out.emplace("cam_to_ego", c2e);
  out.emplace("bev_semantics", bev);
  out.emplace("boxes", boxes);
  out.emplace("velocities", vel);
  out.emplace("scene_index", index);
  if (opts_.frames > 1) add_previous_frames(plan, poses, out);
  return out;
}

SceneRecord DataLoader::read_scene(int64_t scene, const AugmentParams* aug) const {
  SceneRecord rec = select_ ? dataset_->read(scene, sel_) : dataset_->read(scene);
  if (aug) {
    rec = apply_augment(rec, *aug, dataset_->info().bev, box_to_bev_, fit_ ? &*fit_ : nullptr);
  } else if (fit_) {
    fit_images(rec, *fit_);
  }
  return rec;
}

void DataLoader::add_previous_frames(const Plan& plan, const std::vector<SceneRecord>& current,
                                     core::TensorDict& out) const {
  const auto B = static_cast<int64_t>(plan.scenes.size());
  const int64_t F = opts_.frames - 1, N = out_cameras_, H = out_height_, W = out_width_;
  at::Tensor images = alloc({B, F, N, H, W, 3}, at::kByte, pin_);
  at::Tensor intr = alloc({B, F, N, 3, 3}, at::kFloat, pin_);
  at::Tensor c2e = alloc({B, F, N, 4, 4}, at::kFloat, pin_);
  at::Tensor to_current = alloc({B, F, 4, 4}, at::kFloat, pin_);
  at::Tensor repeated = alloc({B, F}, at::kBool, pin_);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t scene = plan.scenes[static_cast<size_t>(b)];
    // The same augmentation for every frame of a sample: the BEV rotation and flip move each
    // frame's cameras and ego pose alike, so the poses between frames stay consistent.
    std::optional<AugmentParams> aug;
    if (opts_.augment) aug = draw_augment(opts_.aug, N, H, W, opts_.seed, plan.epoch, scene);
    const SceneRecord& cur = current[static_cast<size_t>(b)];
    const std::string where = dataset_->shard_of(scene).where(scene);
    if (!cur.ego_to_global.defined()) {
      throw_error<DataError>(
          "{}: data.frames = {} needs each frame's ego pose (ego_to_global), and this scene has "
          "none (a dataset of independent scenes? datagen --sequence-length, or a converted "
          "nuScenes)",
          where, opts_.frames);
    }
    const at::Tensor cur_inv = at::inverse(cur.ego_to_global.to(at::kDouble));
    // Walk back: frame k (1 = the previous keyframe) is the scene k steps back in the sequence,
    // or the earliest one there is, repeated (BEVDet4D at a sequence's start).
    int64_t at_scene = scene;
    for (int64_t k = 0; k < F; ++k) {
      const int64_t prev = dataset_->prev_index(at_scene);
      const bool repeat = prev < 0;
      if (!repeat) at_scene = prev;
      repeated.data_ptr<bool>()[b * F + k] = repeat;
      // At a sequence's start the earliest frame (the current one, or the first of its
      // sequence) stands in; a frame read once for this sample is read again (no cache: the
      // repeats are at most F - 1 per sample, at sequence starts only).
      const SceneRecord frame = read_scene(at_scene, aug ? &*aug : nullptr);
      if (!frame.ego_to_global.defined()) {
        throw_error<DataError>("{}: data.frames = {}: the previous frame {} has no ego pose", where,
                               opts_.frames, dataset_->shard_of(at_scene).where(at_scene));
      }
      std::memcpy(images.data_ptr<uint8_t>() + (b * F + k) * N * H * W * 3,
                  frame.images.contiguous().data_ptr<uint8_t>(),
                  static_cast<size_t>(N * H * W * 3));
      std::memcpy(intr.data_ptr<float>() + (b * F + k) * N * 9,
                  frame.intrinsics.contiguous().data_ptr<float>(), static_cast<size_t>(N * 9) * 4);
      std::memcpy(c2e.data_ptr<float>() + (b * F + k) * N * 16,
                  frame.cam_to_ego.contiguous().data_ptr<float>(), static_cast<size_t>(N * 16) * 4);
      // The previous ego frame in the current one: T_current^-1 T_previous, in double.
      const at::Tensor rel =
          at::matmul(cur_inv, frame.ego_to_global.to(at::kDouble)).to(at::kFloat);
      std::memcpy(to_current.data_ptr<float>() + (b * F + k) * 16,
                  rel.contiguous().data_ptr<float>(), 16 * 4);
    }
  }
  out.emplace("prev_images", images);
  out.emplace("prev_intrinsics", intr);
  out.emplace("prev_cam_to_ego", c2e);
  out.emplace("prev_to_current", to_current);
  out.emplace("prev_repeated", repeated);
}

void DataLoader::worker() {
  for (;;) {
    Plan plan;
    int64_t seq = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_work_.wait(lock, [&] {
        return stop_ || end_seq_ >= 0 || next_plan_seq_ < next_out_seq_ + opts_.prefetch;
      });
      if (stop_ || end_seq_ >= 0) return;
      auto p = plan_next();
      if (!p) {
        end_seq_ = next_plan_seq_;
        lock.unlock();
        cv_ready_.notify_all();
        cv_work_.notify_all();
        return;
      }
      plan = std::move(*p);
      seq = next_plan_seq_++;
    }
    Slot slot;
    slot.after = plan.after;
    try {
      slot.batch = build(plan);
    } catch (...) {
      slot.error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_.emplace(seq, std::move(slot));
    }
    cv_ready_.notify_all();
  }
}

std::optional<core::TensorDict> DataLoader::next() {
  if (workers_.empty()) {
    auto p = plan_next();
    if (!p) return std::nullopt;
    core::TensorDict batch = build(*p);
    std::lock_guard<std::mutex> lock(mu_);
    consumed_ = p->after;
    return batch;
  }
  std::unique_lock<std::mutex> lock(mu_);
  cv_ready_.wait(lock, [&] {
    return ready_.count(next_out_seq_) > 0 || (end_seq_ >= 0 && next_out_seq_ >= end_seq_);
  });
  const auto it = ready_.find(next_out_seq_);
  if (it == ready_.end()) return std::nullopt;
  Slot slot = std::move(it->second);
  ready_.erase(it);
  if (slot.error) {
    // The state keeps pointing at the failed batch; later calls move on to the next one.
    ++next_out_seq_;
    lock.unlock();
    cv_work_.notify_all();
    std::rethrow_exception(slot.error);
  }
  ++next_out_seq_;
  consumed_ = slot.after;
  lock.unlock();
  cv_work_.notify_all();
  return std::move(slot.batch);
}

LoaderState DataLoader::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return consumed_;
}

}  // namespace parallax::data
