#ifdef PARALLAX_WITH_NCCL

// The nccl backend: the ring all-reduce on ncclSend/ncclRecv (nccl_internal.h has the class).
#include "comm/nccl_internal.h"

#include <algorithm>

namespace parallax::comm::detail::nccl {

void NcclCommunicator::connect_ring_peers(const Ticket& t) {
  if (!ctrl_ || ring_peers_ready_) return;
  allgather_bytes(std::vector<uint8_t>{1}, t);
  ring_peers_ready_ = true;
}

void NcclCommunicator::ring(at::Tensor flat, ReduceOp op, const Ticket& t) {
  const int n = size(), r = rank_;
  const ncclComm_t pc = ring_comm();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const int64_t numel = flat.numel();
  const int64_t elem = static_cast<int64_t>(flat.element_size());
  const int64_t seg0 = chunk_numel(numel, n, 0);
  // One column per segment up to 1 GiB: on 2 x H200, 128 MiB columns (reductions overlapping
  // transfers on a second stream) took 4152 us at 1 GiB against 3444 us for one send/recv group
  // per step on one stream (comm_bench raw_ring), docs/comm.md.
  const int64_t chunk = ring_chunk_or(options_, int64_t{1} << 30);
  const int cols =
      static_cast<int>(std::clamp<int64_t>((seg0 * elem + chunk - 1) / chunk, 1, 1024));
  auto view = [&](int seg, int c) {
    const int64_t so = chunk_offset(numel, n, seg), sn = chunk_numel(numel, n, seg);
    return flat.narrow(0, so + chunk_offset(sn, cols, c), chunk_numel(sn, cols, c));
  };
  auto mod = [n](int a) { return ((a % n) + n) % n; };
  const int64_t max_col = chunk_numel(seg0, cols, 0);
  // Allocated on the comm stream, like every temporary of enqueue()'s body (no keep-alive).
  // (Kept alive until the watchdog's next sweep, back-to-back rings each allocated fresh device
  // memory: a 64 MiB ring took 460-527 us that way on 2 x H200, 350 us without.)
  at::Tensor scratch = at::empty({cols, std::max<int64_t>(max_col, 1)}, flat.options());
  // With several columns the reductions run on a second stream so that column c is reduced
  // while column c+1 transfers; a single column has nothing to overlap, so it stays on the comm
  // stream and needs no events.
  const bool overlap = cols > 1;
  const c10::cuda::CUDAStream red = overlap ? reduce_stream_ : stream_;
  std::vector<CudaEvent> transferred(overlap ? static_cast<size_t>(cols) : 0);
  std::vector<CudaEvent> reduced(overlap ? static_cast<size_t>(cols) : 0);
  std::vector<bool> reduced_recorded(static_cast<size_t>(cols), false);  // overlap only
  if (overlap) {
    c10::cuda::CUDACachingAllocator::recordStream(scratch.storage().data_ptr(), red);
    c10::cuda::CUDACachingAllocator::recordStream(flat.storage().data_ptr(), red);
    // The reduce stream starts after everything the comm stream has so far (the caller's data).
    CudaEvent start;
    start.record(stream_);
    start.block(red);
  }
  for (int k = 0; k < 2 * (n - 1); ++k) {
    const bool rs = k < n - 1;
    const int s = k - (n - 1);
    const int send_seg = rs ? mod(r - k) : mod(r + 1 - s);
    const int recv_seg = rs ? mod(r - k - 1) : mod(r - s);
    for (int c = 0; c < cols; ++c) {
      at::Tensor out = view(send_seg, c), in = view(recv_seg, c);
      at::Tensor landing = rs ? scratch[c].narrow(0, 0, in.numel()) : in;
      // The column's previous reduction must be done before it is sent or its scratch reused.
      if (reduced_recorded[static_cast<size_t>(c)]) reduced[static_cast<size_t>(c)].block(stream_);
      group_start(t);
      if (out.numel() > 0) {
        call(ncclSend(out.data_ptr(), static_cast<size_t>(out.numel()),
                      nccl_type(flat.scalar_type()), next, pc, stream_.stream()),
             "ncclSend (ring)", t, pc);
        stats_.p2p_ops += 1;
        stats_.bytes_sent += out.numel() * elem;
      }
      if (in.numel() > 0) {
        call(ncclRecv(landing.data_ptr(), static_cast<size_t>(in.numel()),
                      nccl_type(flat.scalar_type()), prev, pc, stream_.stream()),
             "ncclRecv (ring)", t, pc);
        stats_.p2p_ops += 1;
      }
      group_end(t, pc);
      if (!rs) continue;
      if (overlap) {
        transferred[static_cast<size_t>(c)].record(stream_);
        transferred[static_cast<size_t>(c)].block(red);
      }
      {
        c10::cuda::CUDAStreamGuard sg(red);
        switch (op) {
          case ReduceOp::kSum:
          case ReduceOp::kAvg:
            in.add_(landing);
            break;
          case ReduceOp::kMax:
            at::maximum_out(in, in, landing);
            break;
          case ReduceOp::kMin:
            at::minimum_out(in, in, landing);
            break;
        }
        if (k == n - 2 && op == ReduceOp::kAvg) {
          if (is_float(in.scalar_type())) {
            in.div_(n);
          } else {
            in.div_(n, "trunc");
          }
        }
      }
      if (overlap) {
        reduced[static_cast<size_t>(c)].record(red);
        reduced_recorded[static_cast<size_t>(c)] = true;
      }
    }
  }
  // Everything reduced is also in the comm stream's order from here on.
  for (int c = 0; c < cols; ++c) {
    if (reduced_recorded[static_cast<size_t>(c)]) reduced[static_cast<size_t>(c)].block(stream_);
  }
}

}  // namespace parallax::comm::detail::nccl

#endif  // PARALLAX_WITH_NCCL
