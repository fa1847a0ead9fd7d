#ifdef PARALLAX_WITH_NCCL

// The nccl backend: point-to-point (one NCCL group per batch) (nccl_internal.h has the class).
#include "parallel/comm/nccl_internal.h"

namespace parallax::parallel::comm::detail::nccl {

WorkPtr NcclCommunicator::batch_isend_irecv(std::vector<P2POp>& ops, CallSite site) {
  std::vector<Ticket> tickets;
  std::vector<at::Tensor> tensors;
  for (auto& op : ops) {
    const bool send = op.kind == P2POp::Kind::kSend;
    const char* what = send ? "send" : "recv";
    check_cuda(*this, what, op.tensor);
    check_dtype(*this, what, op.tensor, false);
    check_peer(*this, what, op.peer);
    check_tag(*this, what, op.tag);
    tensors.push_back(op.tensor);
  }
  for (auto& op : ops) {
    OpDesc d =
        tensor_desc(op.kind == P2POp::Kind::kSend ? OpKind::kSend : OpKind::kRecv, op.tensor, site);
    d.root = op.peer;
    d.tag = op.tag;
    tickets.push_back(begin(d));
    if (op.kind == P2POp::Kind::kSend) {
      stats_.bytes_sent += op.tensor.numel() * static_cast<int64_t>(op.tensor.element_size());
    }
  }
  if (ops.empty()) return std::make_shared<DoneWork>();
  return enqueue(tickets, tensors, [&] {
    group_start(tickets[0]);
    for (auto& op : ops) {
      if (op.kind == P2POp::Kind::kSend) {
        call(ncclSend(op.tensor.data_ptr(), static_cast<size_t>(op.tensor.numel()),
                      nccl_type(op.tensor.scalar_type()), op.peer, p2p_comm(), stream_.stream()),
             "ncclSend", tickets[0], p2p_comm());
      } else {
        call(ncclRecv(op.tensor.data_ptr(), static_cast<size_t>(op.tensor.numel()),
                      nccl_type(op.tensor.scalar_type()), op.peer, p2p_comm(), stream_.stream()),
             "ncclRecv", tickets[0], p2p_comm());
      }
    }
    group_end(tickets[0], p2p_comm());
  });
}

}  // namespace parallax::parallel::comm::detail::nccl

#endif  // PARALLAX_WITH_NCCL
