// DDP's options (parallel.ddp.*, parsed once by parallel::Plan::from), shared by DDP and ZeRO's
// gradient buckets (parallel/ddp/ddp.h).
#pragma once

#include "comm/communicator.h"

#include <c10/core/ScalarType.h>

#include <functional>
#include <optional>
#include <string>

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

}  // namespace parallax::parallel::ddp
