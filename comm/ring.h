// Internal: the ring all-reduce of the CPU backends, on top of a backend's non-blocking
// point-to-point messages (the "explicit DDP ring"; the backend's native all-reduce stays the
// default).
//
// Algorithm: the flat tensor is cut into N segments (chunk_numel split); N-1 reduce-scatter steps
// leave rank r owning the reduced segment (r+1) mod N, then N-1 all-gather steps circulate the
// owned segments: 2(N-1) steps, each rank sends 2(N-1)/N x M bytes. For pipelining, every segment
// is cut into C columns of at most CommOptions::ring_chunk_bytes; the columns advance through the
// 2(N-1) steps independently (a column's step s+1 starts as soon as its step s is done), so
// reducing one column overlaps the transfer of the others. Each column has its own tag, so messages
// of different columns (and of concurrent ring ops) never match each other.
//
// Progress: the state machine advances only when polled (progress()); the communicator's Works
// poll it, and every wait in the process polls every pending ring (WorldContext::progress_all).
//
// Policy (the one both CPU backends, mpi and gloo, follow; start_ring_all_reduce): an all-reduce
// runs as this ring when its algorithm is kRing (the call's, else CommOptions::allreduce_algo),
// else as the backend's native all-reduce. 16-bit floats are staged and reduced in float32, then
// copied back; the columns are CommOptions::ring_chunk_bytes, else kCpuRingChunkBytes.
#pragma once

#include "comm/comm_base.h"
#include "comm/communicator.h"

#include <ATen/core/Tensor.h>

#include <exception>
#include <memory>
#include <mutex>
#include <vector>

namespace parallax::comm::detail {

// Non-blocking messages of one backend, addressed by group rank.
class RingTransport {
 public:
  class Request {
   public:
    virtual ~Request() = default;
    virtual bool test() = 0;  // true when complete; throws on a backend error
  };
  virtual ~RingTransport() = default;
  virtual std::unique_ptr<Request> isend(const at::Tensor& t, int peer, int tag) = 0;
  virtual std::unique_ptr<Request> irecv(at::Tensor& t, int peer, int tag) = 0;
};

class RingAllReduce {
 public:
  // Most columns per segment; with more, the columns grow beyond ring_chunk_bytes.
  static constexpr int kMaxColumns = 1024;

  // `flat` is a contiguous 1-D tensor reduced in place (float32/float64/int types; the caller
  // stages 16-bit floats). `tag_base` + column must not collide with other pending rings.
  RingAllReduce(at::Tensor flat, ReduceOp op, int rank, int size, int64_t chunk_bytes, int tag_base,
                RingTransport& transport, CommStats& stats);

  // Advances every column as far as possible without blocking; true when the result is complete.
  bool progress();
  bool done() const { return done_; }
  int columns() const { return columns_; }

  // Bytes one rank sends for a tensor of `numel` elements of `elem_size` bytes over `size` ranks:
  // the sum of the 2(N-1) segments it forwards (2(N-1)/N x M when N divides numel).
  static int64_t bytes_sent_per_rank(int64_t numel, int64_t elem_size, int size, int rank);

 private:
  struct Column {
    int step = 0;  // 0 .. 2(N-1)
    std::unique_ptr<RingTransport::Request> send, recv;
    at::Tensor scratch;
  };
  at::Tensor view(int segment, int column) const;
  void post(int c);
  void reduce_into(const at::Tensor& dst, const at::Tensor& src);

  at::Tensor flat_;
  ReduceOp op_;
  int rank_, size_;
  int columns_ = 1;
  int tag_base_;
  RingTransport& transport_;
  CommStats& stats_;
  std::vector<Column> cols_;
  int remaining_ = 0;
  bool done_ = false;
};

// A pending ring all-reduce as the World's progress list sees it. Keeps its communicator alive;
// stops advancing once the communicator is aborted.
class RingOp : public Progressable {
 public:
  RingOp(std::shared_ptr<CommBase> owner, at::Tensor flat, ReduceOp op, int64_t chunk_bytes,
         int tag_base, RingTransport& transport);
  bool progress_noexcept() override;
  // Advances; true when done. Rethrows an error met while another wait advanced it.
  bool poll();

 private:
  std::shared_ptr<CommBase> owner_;
  std::mutex mu_;
  RingAllReduce ring_;
  std::exception_ptr error_;
};

// The CPU backends' column size when CommOptions::ring_chunk_bytes is 0.
inline constexpr int64_t kCpuRingChunkBytes = int64_t{4} << 20;

// True when a CPU backend's all-reduce of algorithm `algo` runs as the ring (else natively).
inline bool runs_as_ring(AllReduceAlgo algo) {
  return algo == AllReduceAlgo::kRing;
}

// The first tag of op `seq`'s ring: rings cycle through windows of kMaxColumns tags within the
// `tag_count` tags from `first_tag` that the backend leaves to them, so that concurrent rings (and
// user point-to-point messages, outside that range) never match each other's messages.
int ring_tag_base(uint64_t seq, int first_tag, int tag_count);

// Starts the ring all-reduce of `tensor` (reduced in place) under the open ticket `t`, on
// `transport`'s messages with tags from `tag_base`. The caller has checked the arguments and
// completed size-1 groups and empty tensors. Registers the op with the World's progress list;
// the returned Work copies a staged 16-bit tensor back when done.
WorkPtr start_ring_all_reduce(CommBase& comm, Ticket t, at::Tensor& tensor, ReduceOp op,
                              int tag_base, RingTransport& transport);

}  // namespace parallax::comm::detail
