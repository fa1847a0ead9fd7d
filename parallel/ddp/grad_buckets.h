// The gradient buckets shared by DDP (parallel/ddp/ddp.h: all-reduce) and ZeRO
// (parallel/zero/zero.h: reduce-scatter): parameters assigned to buckets in reverse registration
// order, post-accumulate hooks on their AccumulateGrad nodes, each bucket's reduction launched
// asynchronously in index order as its last gradient arrives, overlapped with the rest of
// backward. ddp.h describes the layouts (grouped, flat, reduce-scatter), the reduction dtype,
// no-sync accumulation and unused parameters; everything there except the broadcasts lives here.
//
// Usage per step:  buckets.before_backward(); loss.backward(); buckets.finalize_backward();
// Thread-safety: one training thread; hooks run on autograd's thread while that thread is blocked
// in backward(). Errors: CommError/TimeoutError from the communicator, parallax::Error for usage.
#pragma once

#include "comm/communicator.h"
#include "core/timer.h"
#include "parallel/ddp/ddp_options.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace parallax::parallel::ddp {

struct BucketInfo {
  std::vector<std::string> param_names;  // in the bucket's order
  std::vector<int64_t> offsets;  // element offset of each parameter in the flat buffer (flat mode)
  int64_t numel = 0;
  int64_t padded_numel = 0;  // numel rounded up to a multiple of the group size (reduce-scatter)
  at::ScalarType dtype = at::kFloat;
  int64_t bytes() const { return numel * static_cast<int64_t>(c10::elementSize(dtype)); }
};

// Assigns parameters (given in registration order) to buckets as described above. Exposed for
// tests. `sizes_bytes[i]`, `dtypes[i]` describe parameter i; returns parameter indices per bucket.
std::vector<std::vector<int64_t>> assign_buckets(const std::vector<int64_t>& sizes_bytes,
                                                 const std::vector<at::ScalarType>& dtypes,
                                                 int64_t first_cap_bytes, int64_t cap_bytes);
// The same with a key per parameter: a bucket holds one (dtype, key).
std::vector<std::vector<int64_t>> assign_buckets(const std::vector<int64_t>& sizes_bytes,
                                                 const std::vector<at::ScalarType>& dtypes,
                                                 const std::vector<int>& keys,
                                                 int64_t first_cap_bytes, int64_t cap_bytes);

class GradBuckets {
 public:
  // Assigns `module`'s trainable parameters to buckets and hooks their gradient accumulators.
  // ConfigError for options that do not go together (named). No collective.
  GradBuckets(std::shared_ptr<torch::nn::Module> module, comm::CommPtr dp_group,
              DdpOptions options);
  // Waits for reductions still in flight (never throws).
  virtual ~GradBuckets();
  GradBuckets(const GradBuckets&) = delete;
  GradBuckets& operator=(const GradBuckets&) = delete;

  // Resets per-backward state; call before loss.backward().
  void before_backward();
  // Launches what is left (find_unused), checks every parameter got a gradient, and waits for
  // every bucket's reduction; afterwards each `.grad()` holds the average over the group.
  void finalize_backward();

  void set_require_sync(bool sync) { require_sync_ = sync; }
  bool require_sync() const { return require_sync_; }

  const std::vector<BucketInfo>& buckets() const { return bucket_info_; }
  BucketMode mode() const { return options_.mode; }  // resolved: kFlat or kGrouped
  comm::Communicator& group() { return *group_; }
  // Exposed communication: the time finalize_backward() adds to the step waiting for reductions
  // that backward did not hide. On the CPU, host time of the last step. On a GPU, measured on the
  // compute stream with timing events between the end of backward's kernels and the point where
  // the stream may use the reduced gradients; read without a host sync, so it is the latest step
  // whose events have completed (0 before the first; always 0 with DdpOptions::timing off).
  double last_exposed_comm_ms() const { return exposed_ms_; }
  // Backward time (GPU: compute-stream time from before_backward() to finalize_backward(); CPU:
  // host time) of the same step as last_exposed_comm_ms().
  double last_backward_ms() const { return backward_ms_; }
  // Every parameter's gradient (bucket views in flat mode), in registration order.
  std::vector<at::Tensor> gradients() const;
  // Flat mode: bucket i's flat gradient buffer (padded_numel elements); reduce-scatter: its shard
  // (padded_numel / size elements), which holds the average after a synced finalize_backward().
  const at::Tensor& bucket_buffer(std::size_t i) const { return buckets_.at(i).buffer; }
  // After finalize_backward() with find_unused: whether any rank produced a gradient for trainable
  // parameter `i` (registration order, frozen ones left out); always true without find_unused.
  bool used_anywhere(std::size_t i) const {
    return used_anywhere_.empty() || used_anywhere_.at(i) != 0;
  }
  const at::Tensor& bucket_shard(std::size_t i) const { return buckets_.at(i).shard; }

 protected:
  std::shared_ptr<torch::nn::Module> module_;
  comm::CommPtr group_;
  DdpOptions options_;

 private:
  struct Bucket {
    at::Tensor buffer;              // flat mode: the flat buffer
    at::Tensor shard;               // reduce-scatter: this rank's shard of the reduced buffer
    std::vector<int64_t> params;    // indices into params_
    std::vector<at::Tensor> views;  // flat mode: per parameter, shaped like it
    std::vector<at::Tensor>
        incoming;  // flat mode: per parameter, a new gradient to copy in at launch
    int64_t pending = 0;
    comm::WorkPtr work;
  };

  // The constructor's steps, in its order. Checks the options and resolves kAuto (ConfigError for
  // those that do not go together).
  void resolve_options(bool scatter);
  // Assigns the trainable parameters to buckets; flat buckets get their buffers (and shards) and
  // the parameters' gradients become views of them.
  void build_buckets(bool scatter);
  // Hooks every trainable parameter's AccumulateGrad node: on_accumulated() after each
  // accumulation.
  void install_hooks();
  // Autograd accumulated trainable parameter `i`'s gradient (on autograd's thread): into its
  // bucket as the layout wants it, and marked ready in a synced backward.
  void on_accumulated(std::size_t i);
  void mark_ready(int64_t param_index);
  comm::WorkPtr issue(Bucket& b, std::vector<at::Tensor>& tensors);  // the reduction of one bucket
  bool compressed(at::ScalarType grad_dtype) const;  // reduced through a reduce_dtype copy
  void launch_ready_buckets();  // launches buckets in order while the next one is complete

  std::vector<std::string> names_;
  std::vector<at::Tensor> params_;
  std::vector<int64_t> param_bucket_, param_slot_;
  std::vector<char> ready_;
  std::vector<char> used_anywhere_;  // find_unused: the last synced backward's usage bitmap
  std::vector<Bucket> buckets_;
  std::vector<BucketInfo> bucket_info_;
  std::vector<std::shared_ptr<void>> accumulators_;  // keeps AccumulateGrad nodes (and hooks) alive
  std::size_t next_bucket_ = 0;
  bool require_sync_ = true;
  bool in_backward_ = false;
  double exposed_ms_ = 0, backward_ms_ = 0;
  std::unique_ptr<core::DeviceTimer> backward_timer_, exposed_timer_;
  bool timers_pending_ = false;
  void ensure_timers();
  void collect_timers(bool block);
  std::mutex mu_;
};

// RAII no-sync scope for gradient accumulation micro-steps.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(GradBuckets& ddp) : ddp_(ddp), prev_(ddp.require_sync()) {
    ddp_.set_require_sync(false);
  }
  ~NoSyncGuard() { ddp_.set_require_sync(prev_); }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  GradBuckets& ddp_;
  bool prev_;
};

}  // namespace parallax::parallel::ddp
