// Where the trainer's batches come from: a dataset loader, or synthetic in-memory batches for
// benchmarks and stand-in models. Each data-parallel rank has its own source and sees its own
// samples.
#pragma once

#include "core/tensor_dict.h"
#include "data/data_config.h"
#include "models/model.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace parallax::train {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // The next batch of this rank (CPU tensors, pinned when CUDA is present). Throws
  // parallax::DataError for unreadable data.
  virtual core::TensorDict next() = 0;
  // Batches per epoch for this rank (0 if unbounded).
  virtual int64_t batches_per_epoch() const = 0;
  virtual std::string describe() const = 0;
  // Where next() continues: (epoch, position within the epoch); saved with checkpoints so a
  // resumed run sees exactly the batches it would have seen. Synthetic sources return (0, i).
  virtual std::pair<int64_t, int64_t> position() const = 0;
  // The data's scene description (from dataset.json) when the source reads a dataset.
  virtual std::optional<core::SceneSpec> scene() const { return std::nullopt; }
};

// `count` distinct global batches (dp x `batch_size` samples; this rank's slice is drawn), moved
// to `device` once, then cycled: no I/O, no generation and no host-to-device copy inside the timed
// loop (benchmark mode measures the model and the engines only). Sample j of global batch i is
// model.example_batch(1) drawn from seed derive_seed(seed, i, j); data-parallel rank `rank` holds
// samples [rank * batch_size, (rank + 1) * batch_size). A step's samples therefore depend on the
// global batch only, not on how it is split over ranks: a run resumed with another dp and the same
// global batch sees the same data. `start`: batches already consumed (a resumed run continues the
// cycle where it was; the count is the same on every rank and for every dp).
std::unique_ptr<BatchSource> make_synthetic_source(const models::Model& model, int64_t batch_size,
                                                   int count, uint64_t seed, int rank,
                                                   const c10::Device& device, int64_t start = 0);

// The training split of `cfg.path` for data-parallel rank `rank` of `world`: a repeating,
// shuffled, augmented loader (data::DataLoader) starting at `start` = (epoch, position).
// `seed` must be the same on every rank (the sampler partitions one permutation). `start_world`:
// the data-parallel size `start` was saved with; the ranks' lists interleave one permutation, so
// position p with `start_world` ranks has consumed its first p * start_world scenes, and with
// `world` ranks the stream continues at p * start_world / world (the next epoch if that is not a
// whole position inside this epoch).
std::unique_ptr<BatchSource> make_dataset_source(const data::DataConfig& cfg, uint64_t seed,
                                                 int rank, int world,
                                                 std::pair<int64_t, int64_t> start = {0, 0},
                                                 int start_world = 0);

}  // namespace parallax::train
