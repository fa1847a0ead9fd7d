#ifdef PARALLAX_WITH_NCCL

// The nccl backend: point-to-point (one NCCL group per batch) (nccl_internal.h has the class).
#include "comm/nccl_internal.h"

namespace parallax::comm::detail::nccl {

WorkPtr NcclCommunicator::batch_isend_irecv(std::vector<P2POp>& ops, CallSite site) {
  std::vector<Ticket> tickets;
  std::vector<at::Tensor> tensors;
  for (auto& op : ops) {
    check_p2p_args(op.kind == P2POp::Kind::kSend ? "send" : "recv", op.tensor, op.peer, op.tag);
    tensors.push_back(op.tensor);
  }
  for (auto& op : ops) {
    const OpKind kind = op.kind == P2POp::Kind::kSend ? OpKind::kSend : OpKind::kRecv;
    tickets.push_back(open_rooted(kind, op.tensor, op.peer, site, op.tag));
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

}  // namespace parallax::comm::detail::nccl

#endif  // PARALLAX_WITH_NCCL
