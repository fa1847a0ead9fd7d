#include "train/batch_source.h"

#include "core/rng.h"
#include "data/dataset.h"
#include "data/loader.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <vector>

namespace parallax::train {
namespace {

class SyntheticSource : public BatchSource {
 public:
  SyntheticSource(const models::Model& model, int64_t batch_size, int count, uint64_t seed,
                  int rank, const c10::Device& device, int64_t start)
      : batch_size_(batch_size), next_(static_cast<std::size_t>(start)) {
    // Draw from a private generator state so the model's initialisation stream is untouched.
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor saved;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      saved = gen.get_state();
    }
    for (int i = 0; i < count; ++i) {
      std::vector<core::TensorDict> samples;
      for (int64_t j = rank * batch_size; j < (rank + 1) * batch_size; ++j) {
        {
          std::lock_guard<std::mutex> lock(gen.mutex());
          gen.set_current_seed(
              core::derive_seed(seed, static_cast<uint64_t>(i), static_cast<uint64_t>(j)));
        }
        samples.push_back(model.example_batch(1));
      }
      core::TensorDict batch;
      for (const auto& [key, first] : samples.front()) {
        std::vector<at::Tensor> parts;
        for (const auto& s : samples) parts.push_back(s.at(key));
        batch[key] = at::cat(parts, 0);
      }
      batches_.push_back(core::to_device(batch, device, false));
    }
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(saved);
  }

  core::TensorDict next() override {
    const auto& b = batches_[next_++ % batches_.size()];
    return b;
  }
  int64_t batches_per_epoch() const override { return 0; }
  std::string describe() const override {
    return fmt::format("synthetic in-memory batches ({} distinct, batch {})", batches_.size(),
                       batch_size_);
  }
  std::pair<int64_t, int64_t> position() const override { return {0, static_cast<int64_t>(next_)}; }

 private:
  int64_t batch_size_;
  std::vector<core::TensorDict> batches_;
  std::size_t next_ = 0;
};

class DatasetSource : public BatchSource {
 public:
  DatasetSource(const data::DataConfig& cfg, uint64_t seed, int rank, int world,
                std::pair<int64_t, int64_t> start, int start_world)
      : path_(cfg.path), split_(cfg.train_split) {
    auto ds = data::Dataset::open(cfg.path, cfg.train_split);
    data::LoaderState st;
    st.epoch = start.first;
    st.position = start.second;
    if (start_world > 0 && start_world != world) {
      const int64_t consumed =
          start.second * start_world;  // scenes of the epoch's permutation read
      const auto opts = data::LoaderOptions::from_config(cfg, seed, rank, world, true);
      const int64_t per_epoch =
          data::make_sampler(*ds, opts).samples_used(opts.batch_size, opts.drop_last);
      st.position = consumed / world;
      if (consumed % world != 0 || st.position >= per_epoch) st = {start.first + 1, 0};
    }
    loader_ = std::make_unique<data::DataLoader>(
        ds, data::LoaderOptions::from_config(cfg, seed, rank, world, true), st);
  }
  core::TensorDict next() override { return *loader_->next(); }  // repeating: never ends
  int64_t batches_per_epoch() const override { return loader_->batches_per_epoch(); }
  std::string describe() const override {
    const core::SceneSpec s = loader_->scene_spec();
    const auto& info = loader_->dataset().info();
    std::string input =
        fmt::format("{} camera(s) of {} x {}", s.num_cameras, s.image_height, s.image_width);
    if (!loader_->options().cameras.empty())
      input += fmt::format(" (cameras [{}] of {})", fmt::join(loader_->options().cameras, ", "),
                           info.cameras);
    if (s.image_height != info.image_height || s.image_width != info.image_width) {
      input +=
          fmt::format(" from {} x {} {}", info.image_height, info.image_width, info.image_codec);
      if (loader_->decode_scale() > 1)
        input += fmt::format(" decoded at 1/{}", loader_->decode_scale());
    }
    std::string order;
    if (loader_->options().class_balanced) {
      // data/cbgs.h: the epoch's slots, each class drawn equally often.
      order = fmt::format(" (class-balanced, data.sampler=cbgs: {} slots per epoch)",
                          loader_->sampler().size());
    }
    return fmt::format(
        "'{}' split '{}': {} scenes, {}, {} batches per epoch per rank{}, {} workers", path_,
        split_, loader_->dataset().size(), input, loader_->batches_per_epoch(), order,
        loader_->options().num_workers);
  }
  std::pair<int64_t, int64_t> position() const override {
    const auto st = loader_->state();
    return {st.epoch, st.position};
  }
  std::optional<core::SceneSpec> scene() const override { return loader_->scene_spec(); }

 private:
  std::string path_, split_;
  std::unique_ptr<data::DataLoader> loader_;
};

}  // namespace

std::unique_ptr<BatchSource> make_dataset_source(const data::DataConfig& cfg, uint64_t seed,
                                                 int rank, int world,
                                                 std::pair<int64_t, int64_t> start,
                                                 int start_world) {
  return std::make_unique<DatasetSource>(cfg, seed, rank, world, start, start_world);
}

std::unique_ptr<BatchSource> make_synthetic_source(const models::Model& model, int64_t batch_size,
                                                   int count, uint64_t seed, int rank,
                                                   const c10::Device& device, int64_t start) {
  return std::make_unique<SyntheticSource>(model, batch_size, count, seed, rank, device, start);
}

}  // namespace parallax::train
