// The data loader: batches of one data-parallel rank, read and decoded ahead by worker threads.
//
// Order. Batches form one deterministic sequence per rank: epoch e uses DistributedSampler's list
// for e, cut into batches of `batch_size` from the current position; with `repeat` the sequence
// continues into epoch e+1, e+2, ... forever (training), otherwise it ends after the starting
// epoch (evaluation). Augmentation is drawn per (seed, epoch, scene index). The sequence is the
// same whatever `num_workers` is, and the same after a restore:
//
// Resume. `state()` is the position of the batch the next call to next() returns: (epoch, index
// into this rank's list for that epoch). A loader constructed with that state yields exactly the
// batches the saved one would have yielded next.
//
// Threads. `num_workers` threads build batches (HDF5 read, then augmentation and collation outside
// HDF5's lock) into a reorder buffer of at most `prefetch` batches ahead of the consumer; next()
// hands them out in sequence order. With 0 workers, next() builds the batch itself. Output tensors
// are in pinned memory when CUDA is available and `pin_memory` is set (the trainer copies them
// with non_blocking). An exception thrown while building a batch (DataError naming the file and
// scene, ...) is rethrown by the next() call that would have returned that batch; it never
// terminates the process. next() must be called from one thread at a time; the destructor stops
// and joins the workers.
//
// Batches (docs/data.md): "images" uint8 [B, N, H, W, 3], "intrinsics" float32 [B, N, 3, 3],
// "cam_to_ego" float32 [B, N, 4, 4], "bev_semantics" int64 [B, X, Y], "boxes" float32
// [B, max_boxes, 9] (padding rows: all zero except class = -1), "velocities" float32
// [B, max_boxes, 2] (each box's (vx, vy) in the ego frame, m/s, row for row with "boxes"; NaN
// where the dataset stores none and on padding rows), "scene_index" int64 [B].
#pragma once

#include "core/tensor_dict.h"
#include "data/augment.h"
#include "data/data_config.h"
#include "data/dataset.h"
#include "data/sampler.h"

#include <atomic>
#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace parallax::data {

struct LoaderOptions {
  int64_t batch_size = 2;
  int num_workers = 2;
  int prefetch = 4;
  bool shuffle = true;
  bool drop_last = true;
  bool repeat = true;  // endless across epochs (training); false: one epoch then end (evaluation)
  bool class_balanced = false;  // data.sampler=cbgs (data/cbgs.h); training only
  int64_t frames = 1;           // data.frames: keyframes per sample, the current one included
  bool augment = false;
  AugmentOptions aug;
  bool pin_memory = true;  // only takes effect when CUDA is available
  int64_t max_boxes =
      64;  // boxes per sample after padding; extra boxes (least visible first) are dropped
  uint64_t seed = 0;
  int rank = 0, world = 1;
  // The model's input (data.image_size, data.cameras): 0 x 0 is the stored size; empty cameras
  // all of them. JPEG shards decode at the coarsest DCT scale (1/8, 1/4, 1/2) whose image still
  // covers that size, then resample to it; unselected cameras are never decoded.
  int64_t image_height = 0, image_width = 0;
  std::vector<int64_t> cameras;

  // From the `data` config section: training (repeat, augment per config) or evaluation (one
  // ordered pass, no augmentation, no dropped samples).
  static LoaderOptions from_config(const DataConfig& cfg, uint64_t seed, int rank, int world,
                                   bool training);
};

// The sampler `opts` asks for over `dataset`: class-balanced groups (read from every scene's
// boxes) when opts.class_balanced, else a permutation per epoch (opts.shuffle).
DistributedSampler make_sampler(const Dataset& dataset, const LoaderOptions& opts);

// The scene the model is built for: dataset.json's, with data.image_size and data.cameras
// applied (checked: ConfigError naming the key).
core::SceneSpec loader_scene_spec(const DatasetInfo& info, const DataConfig& cfg);

struct LoaderState {
  int64_t epoch = 0;
  int64_t position = 0;  // index into this rank's list for `epoch` of the next batch's first sample
  bool operator==(const LoaderState&) const = default;
};

class DataLoader {
 public:
  // Throws DataError when the options cannot work (e.g. `repeat` with no full batch per epoch, a
  // flip on an asymmetric BEV grid, a state outside the epoch).
  DataLoader(std::shared_ptr<const Dataset> dataset, LoaderOptions opts, LoaderState start = {});
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next batch, or nullopt at the end (only without `repeat`). Rethrows a worker's error.
  std::optional<core::TensorDict> next();
  // Where next() continues (see the file comment).
  LoaderState state() const;
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  const DistributedSampler& sampler() const { return sampler_; }
  const Dataset& dataset() const { return *dataset_; }
  const LoaderOptions& options() const { return opts_; }
  // Scene `index` as the model sees it without augmentation (cameras selected, fitted to the
  // model's image size): what an evaluation batch holds. Thread-safe.
  SceneRecord read_scene(int64_t index) const;
  // The scenes the batches hold (cameras and image size as selected).
  core::SceneSpec scene_spec() const;
  // The DCT scale JPEG images are decoded at (1 for raw shards or no downscaling).
  int decode_scale() const { return sel_.decode_scale; }

 private:
  struct Plan {
    int64_t epoch = 0;
    std::vector<int64_t> scenes;
    LoaderState after;  // the state once this batch is consumed
  };
  struct Slot {
    core::TensorDict batch;
    std::exception_ptr error;
    LoaderState after;
  };

  // Next batch plan in sequence order (caller holds mu_ when workers run); nullopt at the end.
  std::optional<Plan> plan_next();
  core::TensorDict build(const Plan& plan) const;
  void worker();

  std::shared_ptr<const Dataset> dataset_;
  LoaderOptions opts_;
  DistributedSampler sampler_;
  int64_t batches_per_epoch_ = 0, samples_per_epoch_ = 0;
  int64_t end_epoch_ = 0;  // planning stops at this epoch (only without `repeat`)
  bool pin_ = false;
  // Scene `scene` read as the model sees it: the selected cameras, fitted, augmented with `aug`
  // when training.
  SceneRecord read_scene(int64_t scene, const AugmentParams* aug) const;
  // The previous frames' keys of a batch (data.frames > 1; docs/data.md, "Frames").
  void add_previous_frames(const Plan& plan, const std::vector<SceneRecord>& current,
                           core::TensorDict& out) const;
  std::vector<int> box_to_bev_;
  // What each scene is read as (cameras, decode scale) and fitted to (the model's input).
  int64_t out_cameras_ = 0, out_height_ = 0, out_width_ = 0;
  bool select_ = false;
  ShardReader::Selection sel_;
  std::optional<ImageFit> fit_;
  mutable std::atomic<bool> warned_boxes_{false};

  // Planning state (the producer side).
  LoaderState cursor_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> cached_indices_;

  // Consumer side.
  LoaderState consumed_;

  mutable std::mutex mu_;
  std::condition_variable cv_work_, cv_ready_;
  std::map<int64_t, Slot> ready_;
  int64_t next_plan_seq_ = 0, next_out_seq_ = 0;
  int64_t end_seq_ = -1;  // sequence number of the end (known once planning runs out)
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace parallax::data
