// The `data` config section: where the dataset lives and how it is loaded and augmented.
#pragma once

#include "core/config.h"

#include <string>
#include <vector>

namespace parallax::data {

// `data.aug`: training-time augmentation (data/augment.h has the exact definitions).
struct AugConfig {
  bool photometric = true;
  double brightness = 0.2;
  double contrast = 0.2;
  double saturation = 0.2;
  double hue_deg = 8.0;
  bool geometric = true;
  std::vector<double> resize = {0.94, 1.12};
  double rotate_deg = 10.0;
  bool flip_y = true;

  template <class V>
  void visit(V& v) {
    v("photometric", photometric, "per-camera brightness/contrast/saturation/hue jitter");
    v("brightness", brightness, "brightness factor range 1 +- b", core::Check::between(0, 1));
    v("contrast", contrast, "contrast factor range 1 +- c", core::Check::between(0, 1));
    v("saturation", saturation, "saturation factor range 1 +- s", core::Check::between(0, 1));
    v("hue_deg", hue_deg, "hue rotation range +- degrees", core::Check::between(0, 180));
    v("geometric", geometric,
      "image resize+crop (updates K) and BEV rotation/flip (updates cam_to_ego, labels)");
    v("resize", resize, "image scale range [min, max] before cropping back to the original size",
      core::Check::between(0.25, 4));
    v("rotate_deg", rotate_deg, "BEV rotation about z, uniform in +- degrees",
      core::Check::between(0, 180));
    v("flip_y", flip_y, "BEV flip y -> -y with probability 1/2 (needs a grid symmetric in y)");
  }
};

struct DataConfig {
  std::string path = "datasets/synth";
  bool synthetic = false;  // in-memory random batches (benchmark mode): no files read
  int batch_size = 2;      // per data-parallel rank
  int num_workers = 2;
  int prefetch = 4;
  bool shuffle = true;
  bool drop_last = true;
  bool augment = true;
  // Which scenes an epoch reads (training): "uniform" (every scene once, shuffled) or "cbgs"
  // (class-balanced grouping and sampling, data/cbgs.h).
  std::string sampler = "uniform";
  // Keyframes per sample, the current one included (a temporal model's model.temporal.frames):
  // the loader adds the previous frames of the sample's sequence (docs/data.md, "Frames").
  int frames = 1;
  std::string train_split = "train";
  std::string val_split = "val";
  bool pin_memory = true;
  int max_boxes = 64;
  // The model's input, when not the stored images: [H, W] (empty: the stored size), and the
  // cameras it sees, as indices into the stored rig (empty: all, in order). docs/data.md,
  // "Model input size and cameras".
  std::vector<int64_t> image_size;
  std::vector<int64_t> cameras;
  AugConfig aug;

  template <class V>
  void visit(V& v) {
    v("path", path, "dataset folder (HDF5 shards + dataset.json)");
    v("synthetic", synthetic, "random in-memory batches of the right shapes (benchmarks; no I/O)");
    // Upper bounds keep a typo from asking for unbounded memory or threads (issue 35): 65536
    // samples per rank is beyond any device's memory for these models (bev tiny: ~1 MB a sample).
    v("batch_size", batch_size,
      "samples per step on each data-parallel rank (at most 65536; more through train.grad_accum)",
      core::Check::between(1, 65536));
    v("num_workers", num_workers, "loader threads reading and decoding ahead (at most 256)",
      core::Check::between(0, 256));
    v("prefetch", prefetch, "batches kept ready ahead of the trainer (at most 1024)",
      core::Check::between(1, 1024));
    v("shuffle", shuffle, "reshuffle every epoch (deterministic by seed and epoch)");
    v("drop_last", drop_last, "drop the last incomplete batch of an epoch");
    v("frames", frames,
      "keyframes per sample, the current one included: the previous ones of its sequence come "
      "as prev_images, prev_intrinsics, prev_cam_to_ego and prev_to_current (repeating the "
      "sequence's first frame at its start); needs a dataset with sequences",
      core::Check::between(1, 16));
    v("sampler", sampler,
      "training epochs: uniform (every scene once, shuffled by data.shuffle) or cbgs "
      "(class-balanced grouping and sampling, CenterPoint / mmdetection3d: each class drawn "
      "equally often, afresh each epoch; a scene's copies stay on one rank)",
      core::Check::one_of({"uniform", "cbgs"}));
    v("augment", augment, "photometric and geometric augmentation (train split only)");
    v("train_split", train_split, "split of the dataset used for training");
    v("val_split", val_split, "split of the dataset used for evaluation");
    v("pin_memory", pin_memory, "batches in pinned host memory when CUDA is available");
    v("max_boxes", max_boxes,
      "boxes per sample after padding (extra boxes, least visible first, dropped)",
      core::Check::at_least(1));
    v("image_size", image_size,
      "model input [H, W] (empty: the stored size); JPEG shards decode at 1/2, 1/4 or 1/8 when "
      "that still covers it, then resize; the intrinsics follow exactly");
    v("cameras", cameras,
      "indices of the stored cameras the model sees, in that order (empty: all); the others are "
      "never decoded");
    v("aug", aug);
  }
};

}  // namespace parallax::data
