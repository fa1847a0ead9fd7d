#include "train/batch_source.h"

#include "data/dataset.h"
#include "data/loader.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <vector>

namespace parallax::train {
namespace {

class SyntheticSource : public BatchSource {
 public:
  SyntheticSource(const models::Model& model, int64_t batch_size, int count, uint64_t seed, const c10::Device& device,
                  int64_t start)
      : batch_size_(batch_size), next_(static_cast<std::size_t>(start)) {
    // Draw from a private generator state so the model's initialisation stream is untouched.
    auto gen = at::detail::getDefaultCPUGenerator();
    at::Tensor saved;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      saved = gen.get_state();
      gen.set_current_seed(seed);
    }
    for (int i = 0; i < count; ++i) batches_.push_back(core::to_device(model.example_batch(batch_size), device, false));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(saved);
  }

  core::TensorDict next() override {
    const auto& b = batches_[next_++ % batches_.size()];
    return b;
  }
  int64_t batches_per_epoch() const override { return 0; }
  std::string describe() const override {
    return fmt::format("synthetic in-memory batches ({} distinct, batch {})", batches_.size(), batch_size_);
  }
  std::pair<int64_t, int64_t> position() const override { return {0, static_cast<int64_t>(next_)}; }

 private:
  int64_t batch_size_;
  std::vector<core::TensorDict> batches_;
  std::size_t next_ = 0;
};

class DatasetSource : public BatchSource {
 public:
  DatasetSource(const data::DataConfig& cfg, uint64_t seed, int rank, int world, std::pair<int64_t, int64_t> start)
      : path_(cfg.path), split_(cfg.train_split), max_boxes_(cfg.max_boxes) {
    auto ds = data::Dataset::open(cfg.path, cfg.train_split);
    data::LoaderState st;
    st.epoch = start.first;
    st.position = start.second;
    loader_ = std::make_unique<data::DataLoader>(ds, data::LoaderOptions::from_config(cfg, seed, rank, world, true), st);
  }
  core::TensorDict next() override { return *loader_->next(); }  // repeating: never ends
  int64_t batches_per_epoch() const override { return loader_->batches_per_epoch(); }
  std::string describe() const override {
    return fmt::format("'{}' split '{}': {} scenes, {} batches per epoch per rank, {} workers", path_, split_,
                       loader_->dataset().size(), loader_->batches_per_epoch(), loader_->options().num_workers);
  }
  std::pair<int64_t, int64_t> position() const override {
    const auto st = loader_->state();
    return {st.epoch, st.position};
  }
  std::optional<core::SceneSpec> scene() const override { return loader_->dataset().info().scene_spec(max_boxes_); }

 private:
  std::string path_, split_;
  int64_t max_boxes_;
  std::unique_ptr<data::DataLoader> loader_;
};

}  // namespace

std::unique_ptr<BatchSource> make_dataset_source(const data::DataConfig& cfg, uint64_t seed, int rank, int world,
                                                 std::pair<int64_t, int64_t> start) {
  return std::make_unique<DatasetSource>(cfg, seed, rank, world, start);
}

std::unique_ptr<BatchSource> make_synthetic_source(const models::Model& model, int64_t batch_size,
                                                   int count, uint64_t seed, const c10::Device& device,
                                                   int64_t start) {
  return std::make_unique<SyntheticSource>(model, batch_size, count, seed, device, start);
}

}  // namespace parallax::train
