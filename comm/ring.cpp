// The ring all-reduce of the CPU backends (ring.h): the column state machine, its entry on the
// World's progress list, and the one policy both backends start it with.
#include "comm/ring.h"

#include "comm/poll_work.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace parallax::comm::detail {

namespace {
int mod(int a, int n) {
  return ((a % n) + n) % n;
}
}  // namespace

RingAllReduce::RingAllReduce(at::Tensor flat, ReduceOp op, int rank, int size, int64_t chunk_bytes,
                             int tag_base, RingTransport& transport, CommStats& stats)
    : flat_(std::move(flat)),
      op_(op),
      rank_(rank),
      size_(size),
      tag_base_(tag_base),
      transport_(transport),
      stats_(stats) {
  const int64_t numel = flat_.numel();
  if (size_ == 1 || numel == 0) {
    if (op_ == ReduceOp::kAvg && size_ > 1) flat_.div_(size_);
    done_ = true;
    return;
  }
  const int64_t seg_bytes =
      chunk_numel(numel, size_, 0) * static_cast<int64_t>(flat_.element_size());
  const int64_t chunk = std::max<int64_t>(1, chunk_bytes);
  columns_ = static_cast<int>(std::clamp<int64_t>((seg_bytes + chunk - 1) / chunk, 1, kMaxColumns));
  cols_.resize(static_cast<size_t>(columns_));
  const int64_t max_col = chunk_numel(chunk_numel(numel, size_, 0), columns_, 0);
  for (auto& c : cols_) c.scratch = at::empty({max_col}, flat_.options());
  remaining_ = columns_;
  for (int c = 0; c < columns_; ++c) post(c);
}

at::Tensor RingAllReduce::view(int segment, int column) const {
  const int64_t numel = flat_.numel();
  const int64_t seg_off = chunk_offset(numel, size_, segment),
                seg_n = chunk_numel(numel, size_, segment);
  const int64_t off = seg_off + chunk_offset(seg_n, columns_, column);
  return flat_.narrow(0, off, chunk_numel(seg_n, columns_, column));
}

void RingAllReduce::post(int c) {
  Column& col = cols_[static_cast<size_t>(c)];
  const int next = mod(rank_ + 1, size_), prev = mod(rank_ - 1, size_);
  const int k = col.step;
  int send_seg, recv_seg;
  if (k < size_ - 1) {  // reduce-scatter
    send_seg = mod(rank_ - k, size_);
    recv_seg = mod(rank_ - k - 1, size_);
  } else {  // all-gather
    const int s = k - (size_ - 1);
    send_seg = mod(rank_ + 1 - s, size_);
    recv_seg = mod(rank_ - s, size_);
  }
  at::Tensor out = view(send_seg, c);
  at::Tensor in = view(recv_seg, c);
  if (k < size_ - 1) in = col.scratch.narrow(0, 0, in.numel());
  const int tag = tag_base_ + c;
  // Empty pieces (tensors smaller than size x columns) are skipped on both sides alike: the sizes
  // are a function of (numel, size, columns) that every rank computes identically.
  if (in.numel() > 0) {
    col.recv = transport_.irecv(in, prev, tag);
    stats_.p2p_ops += 1;
  }
  if (out.numel() > 0) {
    col.send = transport_.isend(out, next, tag);
    stats_.p2p_ops += 1;
    stats_.bytes_sent += out.numel() * static_cast<int64_t>(out.element_size());
  }
}

void RingAllReduce::reduce_into(const at::Tensor& dst, const at::Tensor& src) {
  switch (op_) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      dst.add_(src);
      break;
    case ReduceOp::kMax:
      at::maximum_out(const_cast<at::Tensor&>(dst), dst, src);
      break;
    case ReduceOp::kMin:
      at::minimum_out(const_cast<at::Tensor&>(dst), dst, src);
      break;
  }
}

bool RingAllReduce::progress() {
  if (done_) return true;
  for (int c = 0; c < columns_; ++c) {
    Column& col = cols_[static_cast<size_t>(c)];
    while (col.step < 2 * (size_ - 1)) {
      if (col.recv && col.recv->test()) col.recv.reset();
      if (col.send && col.send->test()) col.send.reset();
      if (col.recv || col.send) break;
      const int k = col.step;
      if (k < size_ - 1) {
        const int recv_seg = mod(rank_ - k - 1, size_);
        at::Tensor dst = view(recv_seg, c);
        reduce_into(dst, col.scratch.narrow(0, 0, dst.numel()));
        if (k == size_ - 2 && op_ == ReduceOp::kAvg) {
          // recv_seg is now this rank's fully reduced segment (r+1) mod N.
          if (at::isIntegralType(dst.scalar_type(), false)) {
            dst.div_(size_, "trunc");
          } else {
            dst.div_(size_);
          }
        }
      }
      ++col.step;
      if (col.step < 2 * (size_ - 1)) {
        post(c);
      } else {
        --remaining_;
      }
    }
  }
  if (remaining_ == 0) {
    done_ = true;
    cols_.clear();
  }
  return done_;
}

int64_t RingAllReduce::bytes_sent_per_rank(int64_t numel, int64_t elem_size, int size, int rank) {
  if (size == 1) return 0;
  int64_t elems = 0;
  for (int k = 0; k < size - 1; ++k) elems += chunk_numel(numel, size, mod(rank - k, size));
  for (int s = 0; s < size - 1; ++s) elems += chunk_numel(numel, size, mod(rank + 1 - s, size));
  return elems * elem_size;
}

RingOp::RingOp(std::shared_ptr<CommBase> owner, at::Tensor flat, ReduceOp op, int64_t chunk_bytes,
               int tag_base, RingTransport& transport)
    : owner_(std::move(owner)),
      ring_(std::move(flat), op, owner_->rank(), owner_->size(), chunk_bytes, tag_base, transport,
            owner_->mutable_stats()) {}

bool RingOp::progress_noexcept() {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  if (error_ || owner_->aborted()) return true;  // nothing more to do for the progress list
  try {
    return ring_.progress();
  } catch (...) {
    error_ = std::current_exception();
    return true;
  }
}

bool RingOp::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) std::rethrow_exception(error_);
  return ring_.progress();
}

int ring_tag_base(uint64_t seq, int first_tag, int tag_count) {
  const int window = std::max(1, tag_count / RingAllReduce::kMaxColumns);
  return first_tag +
         static_cast<int>(seq % static_cast<uint64_t>(window)) * RingAllReduce::kMaxColumns;
}

WorkPtr start_ring_all_reduce(CommBase& comm, Ticket t, at::Tensor& tensor, ReduceOp op,
                              int tag_base, RingTransport& transport) {
  // Summing 16-bit floats hop by hop would round at every step: the ring reduces in float32.
  const bool staged =
      tensor.scalar_type() == c10::ScalarType::Half || tensor.scalar_type() == at::kBFloat16;
  at::Tensor work = staged ? tensor.to(at::kFloat) : tensor;
  at::Tensor target = tensor;
  auto ring = std::make_shared<RingOp>(comm.shared_from_this(), work.view({-1}), op,
                                       ring_chunk_or(comm.options(), kCpuRingChunkBytes), tag_base,
                                       transport);
  comm.ctx()->add_progressable(ring);
  auto on_done = [staged, work, target]() mutable {
    if (staged) target.copy_(work);
  };
  // The buffers and the ring outlive an abandoned op (PollWork buries them).
  auto keep = std::make_shared<std::pair<std::vector<at::Tensor>, std::shared_ptr<RingOp>>>(
      std::vector<at::Tensor>{work, target}, ring);
  return std::make_shared<PollWork>(
      comm.shared_from_this(), std::move(t), [ring] { return ring->poll(); }, on_done, keep);
}

}  // namespace parallax::comm::detail
