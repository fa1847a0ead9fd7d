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

#include "comm/communicator.h"
#include "parallel/ddp/grad_buckets.h"

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace parallax::parallel::ddp {

// PyTorch's DistributedDataParallel: wrapping broadcasts every parameter and buffer from rank 0 of
// the group, then the gradient buckets (grad_buckets.h) reduce the gradients.
class DistributedDataParallel : public GradBuckets {
 public:
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, comm::CommPtr dp_group,
                          DdpOptions options);

  // Broadcasts buffers from rank 0 when broadcast_buffers is on (call before each forward).
  void before_forward();
};

// Every parameter and buffer of `module` from rank 0 of `group` (one flat broadcast per dtype and
// device); nothing with one rank.
void broadcast_module(torch::nn::Module& module, comm::Communicator& group);
// The buffers alone (DDP's broadcast_buffers before each forward).
void broadcast_buffers(torch::nn::Module& module, comm::Communicator& group);

}  // namespace parallax::parallel::ddp
