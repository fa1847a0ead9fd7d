#include "comm/bandwidth.h"

#include "comm/factory.h"
#include "core/error.h"
#include "core/timer.h"

#include <ATen/ATen.h>

namespace parallax::comm {

Bandwidth measure_bus_bandwidth(World& world, bool cuda, int64_t mib) {
  CommOptions o;
  o.timeout_s = 120;
  const auto comm = make_world_communicator(world, cuda ? "nccl" : "gloo", o);
  const int n = comm->size();
  at::TensorOptions opts = at::TensorOptions().dtype(at::kFloat);
  if (cuda) opts = opts.device(*world.device());
  const int64_t elements = mib * (1 << 20) / 4;
  at::Tensor buf = at::ones({elements}, opts);
  for (int i = 0; i < 2; ++i) comm->all_reduce_async(buf, ReduceOp::kAvg)->wait();
  const int reps = 5;
  core::Stopwatch w;
  for (int i = 0; i < reps; ++i) comm->all_reduce_async(buf, ReduceOp::kAvg)->wait();
  const bool ones = buf.min().item<float>() == 1.0f && buf.max().item<float>() == 1.0f;
  at::Tensor t = at::full({1}, w.elapsed_s() / reps, opts.dtype(at::kDouble));
  comm->all_reduce_async(t, ReduceOp::kMax)->wait();
  PARALLAX_CHECK(ones, CommError,
                 "plan --measure-bandwidth: rank {}: the averaged buffer is not all ones",
                 comm->rank());
  Bandwidth b;
  b.seconds = t.cpu().item<double>();
  b.bytes = static_cast<double>(elements) * 4.0;
  b.busbw_gbps = 2.0 * (n - 1) / n * b.bytes / b.seconds / 1e9;
  b.ranks = n;
  b.rank = comm->rank();
  b.backend = comm->backend();
  return b;
}

}  // namespace parallax::comm
