// Internal: the `mpi` backend (CPU tensors). Every op is an MPI non-blocking call (MPI_Iallreduce,
// MPI_Ireduce_scatter, MPI_Iallgatherv, MPI_Ibcast, MPI_Isend/Irecv, MPI_Ibarrier) polled with
// MPI_Test against the op's deadline. 16-bit floats are reduced through a float32 staging copy
// (more accurate than 16-bit partial sums, and MPI has no 16-bit float type); data movement sends
// them as raw 16-bit words. Collectives, user point-to-point and the ring each run on their own
// duplicate of the group's MPI communicator, so their messages can never match each other.
#pragma once

#include "comm/comm_base.h"
#include "comm/ring.h"

#include <mpi.h>

namespace parallax::comm::detail {

class MpiCommunicator final : public CommBase, public RingTransport {
 public:
  // Creates the world communicator (collective over MPI_COMM_WORLD; init timeout).
  static std::shared_ptr<MpiCommunicator> create_world(const std::shared_ptr<WorldContext>& ctx,
                                                       const CommOptions& options);
  // Takes ownership of `comm`.
  MpiCommunicator(std::shared_ptr<WorldContext> ctx, MPI_Comm comm, std::string name,
                  std::string uid, std::vector<int> world_ranks, CommOptions options);
  ~MpiCommunicator() override;

  std::string backend() const override { return "mpi"; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }

  WorkPtr all_reduce_async(at::Tensor& tensor, ReduceOp op, CallSite site) override;
  WorkPtr all_reduce_async(at::Tensor& tensor, ReduceOp op, AllReduceAlgo algo,
                           CallSite site) override;
  WorkPtr reduce_scatter_async(const at::Tensor& input, at::Tensor& output, ReduceOp op,
                               CallSite site) override;
  WorkPtr all_gather_async(const at::Tensor& input, at::Tensor& output, CallSite site) override;
  WorkPtr all_gather_async(const at::Tensor& input, std::vector<at::Tensor>& outputs,
                           CallSite site) override;
  WorkPtr broadcast_async(at::Tensor& tensor, int root, CallSite site) override;
  WorkPtr send_async(const at::Tensor& tensor, int peer, int tag, CallSite site) override;
  WorkPtr recv_async(at::Tensor& tensor, int peer, int tag, CallSite site) override;
  WorkPtr barrier_async(BarrierKind kind, CallSite site) override;

  std::unique_ptr<Request> isend(const at::Tensor& t, int peer, int tag) override;
  std::unique_ptr<Request> irecv(at::Tensor& t, int peer, int tag) override;

  void release_backend() noexcept override;

 protected:
  std::vector<std::vector<uint8_t>> allgather_bytes(const std::vector<uint8_t>& mine,
                                                    const Ticket& t) override;
  std::shared_ptr<CommBase> create_child(int color, const std::vector<int>& members,
                                         const std::string& name, const std::string& uid,
                                         const Ticket& t) override;
  void abort_backend() noexcept override {}
  void check_op_dtype(const char* op, const at::Tensor& t, bool reduces) const override;

 private:
  WorkPtr make_work(Ticket t, std::shared_ptr<std::vector<MPI_Request>> reqs,
                    std::function<void()> on_done, std::shared_ptr<void> keep_alive);
  void check_mpi(int rc, const char* what) const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm p2p_ = MPI_COMM_NULL;
  MPI_Comm ring_ = MPI_COMM_NULL;
  int tag_ub_ = 32767;
  bool released_ = false;
};

}  // namespace parallax::comm::detail
