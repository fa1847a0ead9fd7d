// Distributed data parallel with PyTorch-DDP semantics, in C++.
//
// - Wrapping broadcasts every parameter and buffer from rank 0 of the data-parallel group, so all
//   replicas start identical.
// - Parameters that require grad are assigned to gradient buckets in reverse registration order
//   (the order autograd produces their gradients), the first bucket capped at first_bucket_mb so
//   communication starts early, the others at bucket_mb; a parameter larger than the cap gets a
//   bucket of its own. A bucket holds one dtype on one device.
// - Two bucket layouts (DdpOptions::mode). Grouped (the default where it applies: NCCL, the
//   native all-reduce in the gradients' dtype): a bucket is a list of parameters; its gradients, as
//   autograd produced them, are all-reduced in place with one grouped call (ncclGroupStart/End
//   around one all-reduce per gradient on NCCL): no flat buffer and no copy in (measurements in
//   docs/PERFORMANCE.md). Flat (CPU backends, the ring, reduce_dtype, or asked for) as described
//   next.
// - Flat: each parameter's `.grad()` is a view into its bucket's flat buffer, so gradients are
// reduced
//   in place with no copy out (gradient_as_bucket_view). Gradients may be cleared either way:
//   `Optimizer::zero_grad(true)` (what the trainer does: the first gradient of the next backward is
//   copied into the bucket, which restores the view; one read and one write) or `zero_grad(false)`
//   (zero in place, then accumulate: a write, then two reads and a write). In a synced backward
//   those copies are batched: the hook only keeps the new gradient, and the bucket copies all of
//   them with one multi-tensor copy (`_foreach_copy_`) just before its all-reduce, so the backward
//   thread launches one kernel per bucket instead of one per parameter (bench/NOTES.md lever 14).
// - A post-accumulate hook on each parameter's AccumulateGrad node marks it ready; when a bucket
//   is full its all-reduce (native or ring) is launched asynchronously, overlapping the rest of
//   backward. Buckets are launched strictly in index order, so every rank issues the same
//   collective sequence even if hooks fire in a different order.
// - Averaging: each bucket is all-reduced with ReduceOp::kAvg, i.e. summed then divided by the
//   data-parallel size (post-divide).
// - Reduction dtype (DdpOptions::reduce_dtype, flat layout): by default gradients are reduced in
//   their own dtype (fp32, as PyTorch DDP). bf16 or fp16 all-reduces a copy of each fp32 bucket in
//   that dtype (Communicator::all_reduce_compressed: half the bytes, the casts on the comm stream)
//   and casts the average back into the bucket: PyTorch's bf16_compress_hook, DeepSpeed's
//   communication_data_type, Megatron-Core's reduction of bf16 gradients. The averaged gradients
//   then carry that dtype's rounding (bf16: 8 significant bits).
// - Gradient accumulation: inside a NoSyncGuard (or set_require_sync(false)) hooks do nothing and
//   gradients accumulate locally (in the bucket views when flat); the first backward with sync on
//   reduces the accumulated sums. No collective is issued during no-sync micro-steps.
// - Unused parameters: by default, a parameter that got no gradient in a synced backward is an
//   error naming it (every rank raises it, before any rank blocks). With find_unused, such
//   parameters count as ready with a zero gradient at finalize_backward(), and one small
//   all-reduce of a usage bitmap per step finds those no rank used: their `.grad()` is left
//   undefined, as in PyTorch, so optimizers skip them.
// - Activation checkpointing (reentrant recomputation) is supported: each parameter is still
//   accumulated once per backward. A parameter marked ready twice in one backward is an error
//   naming it.
//
// - Reduce-scatter (DdpOptions::reduction, ZeRO's gradient buckets, parallel/zero): flat buckets
//   keyed by dtype and by DdpOptions::bucket_key (the optimizer's parameter group: weight decay
//   differs per group), each padded to a multiple of the group size; instead of an all-reduce each
//   bucket is reduce-scattered (average) into its shard (bucket_shard()): rank r receives elements
//   [r * S, (r + 1) * S) of the padded bucket, S = padded numel / group size.
//
// Usage per step:  ddp.before_forward(); loss = ...; ddp.before_backward(); loss.backward();
//                  ddp.finalize_backward(); optimizer.step(lr);
// Thread-safety: one training thread; hooks run on autograd's thread while that thread is blocked
// in backward(). Errors: CommError/TimeoutError from the communicator, parallax::Error for usage.
#pragma once

#include "core/timer.h"
#include "parallel/comm/communicator.h"

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace parallax::parallel::ddp {

// kAuto: grouped on device backends (NCCL) with the native all-reduce in the gradients' dtype,
// flat otherwise (the ring and reduce_dtype need a flat buffer; the CPU backends run a grouped
// all-reduce through a flat copy and back).
enum class BucketMode { kAuto, kFlat, kGrouped };
const char* to_string(BucketMode mode);
BucketMode parse_bucket_mode(const std::string& name);  // "auto" | "flat" | "grouped"

enum class Reduction { kAllReduce, kReduceScatter };

struct DdpOptions {
  BucketMode mode = BucketMode::kAuto;  // kGrouped needs algo kNative and no reduce_dtype
  // kReduceScatter: flat buckets padded to a multiple of the group size, each reduce-scattered into
  // its shard (needs mode flat or auto, algo native, no reduce_dtype).
  Reduction reduction = Reduction::kAllReduce;
  // Parameters with different keys never share a bucket (e.g. the optimizer's parameter group);
  // empty: one key for all.
  std::function<int(const std::string& param_name)> bucket_key;
  // Reduce-scatter only (ZeRO-2): no persistent flat gradient buffers. A bucket's buffer is
  // allocated when its first gradient of a backward arrives; each gradient is copied in and the
  // parameter's own gradient dropped at once; after the reduce-scatter the buffer is released (its
  // memory returns when the collective completes), so between steps a rank holds only its shards.
  // Every backward must be synced (no no-sync accumulation: accumulate the shards instead).
  bool transient = false;
  // Called right after bucket i's reduction is issued (every gradient of it has arrived), on the
  // thread that marked its last gradient ready (autograd's, or the caller of finalize_backward),
  // under the reducer's lock: it must not call back into the reducer. ZeRO-3 frees the bucket's
  // gathered parameters there.
  std::function<void(std::size_t bucket)> on_launch;
  double bucket_mb = 25.0;
  double first_bucket_mb = 1.0;
  bool find_unused = false;
  bool broadcast_buffers = true;
  comm::AllReduceAlgo algo = comm::AllReduceAlgo::kNative;
  // nullopt: each bucket in its gradients' dtype; kBFloat16/kHalf: through a copy in that dtype
  // where it is narrower than the gradients' (flat layout only).
  std::optional<at::ScalarType> reduce_dtype;
  // Backward and exposed-communication timers (last_backward_ms, last_exposed_comm_ms). Off under
  // CUDA graph capture (train.cuda_graph): events recorded in a capture cannot be timed or queried.
  bool timing = true;
};

// "grad" (nullopt) | "bf16" | "fp16" (parallel.ddp.reduce_dtype).
std::optional<at::ScalarType> parse_reduce_dtype(const std::string& name);

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

class DistributedDataParallel {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, comm::CommPtr dp_group,
                          DdpOptions options);
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  // Broadcasts buffers from rank 0 when broadcast_buffers is on (call before each forward).
  void before_forward();
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

  void mark_ready(int64_t param_index);
  comm::WorkPtr issue(Bucket& b, std::vector<at::Tensor>& tensors);  // the reduction of one bucket
  bool compressed(at::ScalarType grad_dtype) const;  // reduced through a reduce_dtype copy
  void launch_ready_buckets();  // launches buckets in order while the next one is complete
  void broadcast_coalesced(std::vector<at::Tensor> tensors);

  std::shared_ptr<torch::nn::Module> module_;
  comm::CommPtr group_;
  DdpOptions options_;
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
  explicit NoSyncGuard(DistributedDataParallel& ddp) : ddp_(ddp), prev_(ddp.require_sync()) {
    ddp_.set_require_sync(false);
  }
  ~NoSyncGuard() { ddp_.set_require_sync(prev_); }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  DistributedDataParallel& ddp_;
  bool prev_;
};

}  // namespace parallax::parallel::ddp
