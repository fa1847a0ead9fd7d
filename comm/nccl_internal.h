// Internal to the nccl backend (comm/nccl_communicator.h): the communicator class and
// the helpers its files share. Included only by the nccl_*.cpp files, which are compiled only
// when PARALLAX_WITH_NCCL is defined. The class is split by concern:
//   nccl_bootstrap.cpp    the world communicator (unique id, init, the blocking twin), splits
//   nccl_collectives.cpp  all-reduce (native, compressed, coalesced), reduce-scatter, all-gather,
//                         broadcast, barrier, and the NCCL call/group wrappers
//   nccl_p2p.cpp          send, recv and batch_isend_irecv (one group per batch)
//   nccl_ring.cpp         the ring all-reduce on ncclSend/ncclRecv
//   nccl_watchdog.cpp     the watchdog thread, timeouts, abort and shutdown, NcclWork
#pragma once

#include "comm/comm_base.h"
#include "comm/nccl_communicator.h"
#include "core/error.h"
#include "core/log.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace parallax::comm::detail::nccl {

// ---- helpers (nccl_collectives.cpp, nccl_bootstrap.cpp) -----------------------------------------

bool is_float(c10::ScalarType t);
// ncclNumTypes for a dtype NCCL cannot carry.
ncclDataType_t nccl_type(c10::ScalarType t);
// Integers are averaged as a sum followed by a truncating division (the CPU backends' rule).
ncclRedOp_t nccl_op(ReduceOp op, c10::ScalarType t);
void divide_avg_if_needed(at::Tensor t, ReduceOp op, int n);
std::string nccl_error(ncclResult_t rc, ncclComm_t comm);
// Polls a non-blocking communicator until its pending call finished (ncclSuccess), it failed
// (CommError) or `deadline` passed (TimeoutError).
void wait_ready(ncclComm_t comm, Clock::time_point deadline, const std::string& what);
Clock::time_point after(double seconds);
ncclConfig_t nonblocking_config();
// The blocking data-path twin of the non-blocking `ctrl` (collective over ctrl's ranks).
// Throws TimeoutError/CommError; `what` names the group for the message.
ncclComm_t make_blocking_twin(ncclComm_t ctrl, int rank, Clock::time_point deadline,
                              const std::string& what);

// A CUDA event (timing disabled) owned by RAII; created on the device current at construction.
class CudaEvent {
 public:
  CudaEvent() {
    check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  ~CudaEvent() {
    if (event_) cudaEventDestroy(event_);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  void record(const c10::cuda::CUDAStream& s) {
    check(cudaEventRecord(event_, s.stream()), "cudaEventRecord");
  }
  // Makes `s` wait for the last record (without blocking the host).
  void block(const c10::cuda::CUDAStream& s) const {
    check(cudaStreamWaitEvent(s.stream(), event_, 0), "cudaStreamWaitEvent");
  }
  bool query() const {
    const cudaError_t rc = cudaEventQuery(event_);
    if (rc == cudaErrorNotReady) return false;
    check(rc, "cudaEventQuery");
    return true;
  }

 private:
  static void check(cudaError_t rc, const char* what) {
    if (rc != cudaSuccess) throw CommError(fmt::format("{}: {}", what, cudaGetErrorString(rc)));
  }
  cudaEvent_t event_ = nullptr;
};

// One enqueued op (or batch): its tickets and end event, as the watchdog tracks it. It holds no
// tensors: the watchdog sweeps every 100 ms, and holding an op's tensors until then kept several
// steps of DDP gradients alive at once (bench/NOTES.md lever 23).
struct Pending {
  std::vector<Ticket> tickets;
  std::shared_ptr<CudaEvent> end;
  std::atomic<bool> completed{false};
  std::atomic<bool> timed_out{false};
  bool internal = false;  // a helper exchange of another op (debug check): not recorded as that op
  // Enqueued while the caller's stream was being captured into a CUDA graph: nothing ran, and the
  // end event exists only inside the capture (it orders streams but cannot be queried).
  bool captured = false;
};

class NcclCommunicator;

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclCommunicator> comm, std::shared_ptr<Pending> p,
           std::vector<at::Tensor> tensors)
      : comm_(std::move(comm)), p_(std::move(p)), tensors_(std::move(tensors)) {}
  void wait() override;
  void wait_stream() override;
  bool is_completed() override;

 private:
  bool poll();
  std::shared_ptr<NcclCommunicator> comm_;
  std::shared_ptr<Pending> p_;
  // The op's tensors, for as long as the caller holds the work (as PyTorch's work objects do).
  // Memory safety does not depend on it: enqueue() records them on the comm stream.
  std::vector<at::Tensor> tensors_;
};

class NcclCommunicator final : public CommBase {
 public:
  // `comm`: the data path; `ctrl`: the non-blocking control communicator (nullptr: comm itself).
  // Takes ownership of both.
  NcclCommunicator(std::shared_ptr<WorldContext> ctx, ncclComm_t comm, ncclComm_t ctrl,
                   c10::Device device, std::string name, std::string uid, int rank,
                   std::vector<int> world_ranks, CommOptions options);

  ~NcclCommunicator() override;

  std::string backend() const override { return "nccl"; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CUDA; }
  const c10::Device& device() const { return device_; }

  // ---- ops -----------------------------------------------------------------------------------

  WorkPtr all_reduce_async(at::Tensor& tensor, ReduceOp op, CallSite site) override {
    return all_reduce_async(tensor, op, options_.allreduce_algo, site);
  }

  WorkPtr all_reduce_async(at::Tensor& tensor, ReduceOp op, AllReduceAlgo algo,
                           CallSite site) override;

  // The wire copy is made, reduced and cast back on the comm stream, so both casts overlap the
  // caller's work (DDP: the rest of backward). ncclAvg on a floating type multiplies by 1/n before
  // summing (NCCL's PreMulSum).
  WorkPtr all_reduce_compressed_async(at::Tensor& tensor, ReduceOp op, at::ScalarType wire,
                                      AllReduceAlgo algo, CallSite site) override;

  // One ticket for the whole group (one flight-recorder entry, one sequence number), so a
  // 150-tensor DDP step costs the host 14 ticket/event pairs rather than 150.
  WorkPtr all_reduce_coalesced_async(std::vector<at::Tensor>& tensors, ReduceOp op,
                                     CallSite site) override;

  WorkPtr reduce_scatter_async(const at::Tensor& input, at::Tensor& output, ReduceOp op,
                               CallSite site) override;

  WorkPtr all_gather_async(const at::Tensor& input, at::Tensor& output, CallSite site) override;

  WorkPtr all_gather_async(const at::Tensor& input, std::vector<at::Tensor>& outputs,
                           CallSite site) override;

  WorkPtr broadcast_async(at::Tensor& tensor, int root, CallSite site) override;

  WorkPtr send_async(const at::Tensor& tensor, int peer, int tag, CallSite site) override {
    std::vector<P2POp> ops{{P2POp::Kind::kSend, tensor, peer, tag}};
    return batch_isend_irecv(ops, site);
  }

  WorkPtr recv_async(at::Tensor& tensor, int peer, int tag, CallSite site) override {
    std::vector<P2POp> ops{{P2POp::Kind::kRecv, tensor, peer, tag}};
    return batch_isend_irecv(ops, site);
  }

  WorkPtr batch_isend_irecv(std::vector<P2POp>& ops, CallSite site) override;

  WorkPtr barrier_async(BarrierKind kind, CallSite site) override;

  void release_backend() noexcept override;

  // Called by a wait whose deadline passed (main thread) or by the watchdog.
  [[noreturn]] void timeout(const std::shared_ptr<Pending>& p);

  [[noreturn]] void rethrow_failure(const std::shared_ptr<Pending>& p);

  void mark_completed(const std::shared_ptr<Pending>& p);

 protected:
  std::vector<std::vector<uint8_t>> allgather_bytes(const std::vector<uint8_t>& mine,
                                                    const Ticket& t) override;

  std::shared_ptr<CommBase> create_child(int color, const std::vector<int>& members,
                                         const std::string& name, const std::string& uid,
                                         const Ticket& t) override;

  void abort_backend() noexcept override;

  // Also checks that `t` is on this communicator's device.
  void check_op_tensor(const char* op, const at::Tensor& t, bool contiguous) const override;
  void check_op_dtype(const char* op, const at::Tensor& t, bool reduces) const override;

 private:
  // Runs `body` (NCCL calls and post-processing) on the comm stream, after the caller's stream.
  template <class F>
  WorkPtr enqueue(std::vector<Ticket> tickets, std::vector<at::Tensor> tensors, F&& body,
                  bool record = true) {
    c10::cuda::CUDAGuard guard(device_);
    auto p = std::make_shared<Pending>();
    p->tickets = std::move(tickets);
    p->internal = !record;
    const Ticket& t = p->tickets[0];
    try {
      const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device_.index());
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      const cudaError_t rc = cudaStreamIsCapturing(caller.stream(), &capture);
      if (rc != cudaSuccess)
        throw CommError(fmt::format("cudaStreamIsCapturing: {}", cudaGetErrorString(rc)));
      // While the caller's stream is captured, the comm stream joins the capture through `ready`
      // and NCCL records its kernels into the graph (NCCL >= 2.9); the caller's wait_stream() on
      // `end` joins it back.
      p->captured = capture == cudaStreamCaptureStatusActive;
      CudaEvent ready;
      ready.record(caller);
      ready.block(stream_);
      for (auto& x : tensors) {
        if (x.defined() && x.numel() > 0)
          c10::cuda::CUDACachingAllocator::recordStream(x.storage().data_ptr(), stream_);
      }
      // Temporaries that `body` allocates are on the comm stream, so the caching allocator reuses
      // their memory in that stream's order once `body` drops them: they need no keep-alive.
      {
        c10::cuda::CUDAStreamGuard sg(stream_);
        body();
      }
      p->end = std::make_shared<CudaEvent>();
      p->end->record(stream_);
    } catch (const TimeoutError&) {
      fail_timeout(t, " (while enqueueing)");
    } catch (const std::exception& e) {
      fail_error(t, e.what());
    }
    if (p->captured) {
      // Not the watchdog's: nothing runs until a replay, which the graph's owner bounds.
      p->completed = true;
      if (record) {
        for (const auto& x : p->tickets) captured(x);
      }
    } else if (record) {
      std::lock_guard<std::mutex> lock(pending_mu_);
      pending_.push_back(p);
    }
    return std::make_shared<NcclWork>(
        std::static_pointer_cast<NcclCommunicator>(shared_from_this()), p, std::move(tensors));
  }

  // Point-to-point traffic (send/recv, batches, the ring) runs on the non-blocking control
  // communicator when there is one: its first contact with a peer connects lazily, and only a
  // non-blocking communicator lets that wait honour the deadline when the peer never comes.
  // Collectives stay on comm_, whose connections were made at creation (NCCL_RUNTIME_CONNECT=0).
  ncclComm_t p2p_comm() const { return ctrl_ ? ctrl_ : comm_; }

  // The ring's point-to-point messages go over the blocking data path comm_ when there is one
  // (NCCL's non-blocking enqueue measured ~100 us per collective against ~30 us blocking): on the
  // non-blocking control communicator the ring was 42-45% of native at 64 MiB, on comm_ 52-60%,
  // and a ring written directly on ncclSend/ncclRecv of a blocking communicator 82-84%
  // (docs/comm.md). Their first contact
  // with the ring neighbours connects them on the host, which on a blocking communicator cannot
  // time out if a neighbour never calls; so the first ring op first checks, under its deadline,
  // that every rank of the group has reached it (a one-byte all-gather on comm_, whose collective
  // connections exist since creation): after that the neighbours are known to be there.
  void connect_ring_peers(const Ticket& t);
  ncclComm_t ring_comm() const { return ring_peers_ready_ ? comm_ : p2p_comm(); }

  // `comm`: the communicator the call was made on (nullptr: comm_).
  void call(ncclResult_t rc, const char* what, const Ticket& t, ncclComm_t comm = nullptr);
  void group_start(const Ticket& t) { call(ncclGroupStart(), "ncclGroupStart", t); }
  void group_end(const Ticket& t, ncclComm_t comm) {
    call(ncclGroupEnd(), "ncclGroupEnd", t, comm);
  }

  // One all-reduce of a contiguous tensor, on the comm stream (inside enqueue()'s body).
  void reduce_in_place(at::Tensor& x, ReduceOp op, AllReduceAlgo algo, const Ticket& t);

  // All-gather of pieces of sizes[r] elements into outs[r], each padded to the largest.
  void gather_padded(const at::Tensor& in, const std::vector<int64_t>& sizes,
                     std::vector<at::Tensor>& outs, const Ticket& t);

  // Ring all-reduce with ncclSend/ncclRecv inside ncclGroupStart/End per step and column.
  // Transfers run on the comm stream; with several columns the reductions run on a second stream
  // and per-column events let column c+1 transfer while column c is reduced (see ring.h for the
  // schedule); one column stays on the comm stream.
  void ring(at::Tensor flat, ReduceOp op, const Ticket& t);

  void watchdog();

  ncclComm_t comm_;
  ncclComm_t ctrl_ = nullptr;  // non-blocking control twin of comm_ (splits); nullptr: comm_
  c10::Device device_;
  c10::cuda::CUDAStream stream_;
  c10::cuda::CUDAStream reduce_stream_;
  at::Tensor barrier_buf_;
  bool ring_peers_ready_ = false;  // connect_ring_peers() succeeded: the ring runs on comm_
  std::mutex pending_mu_;
  std::condition_variable watchdog_cv_;
  std::vector<std::shared_ptr<Pending>> pending_;
  bool stop_ = false;
  std::thread watchdog_;
  std::mutex fail_mu_;
  std::mutex abort_mu_;
  bool comm_aborted_ = false;
  bool released_ = false;
};

}  // namespace parallax::comm::detail::nccl
