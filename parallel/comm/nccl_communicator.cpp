#ifdef PARALLAX_WITH_NCCL

#include "parallel/comm/nccl_communicator.h"

#include "core/error.h"
#include "core/log.h"
#include "parallel/comm/comm_base.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

namespace parallax::parallel::comm::detail {

namespace {

bool is_float(c10::ScalarType t) {
  return at::isFloatingType(t);
}

ncclDataType_t nccl_type(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
      return ncclFloat32;
    case c10::ScalarType::Double:
      return ncclFloat64;
    case c10::ScalarType::Half:
      return ncclFloat16;
    case c10::ScalarType::BFloat16:
      return ncclBfloat16;
    case c10::ScalarType::Long:
      return ncclInt64;
    case c10::ScalarType::Int:
      return ncclInt32;
    case c10::ScalarType::Byte:
      return ncclUint8;
    case c10::ScalarType::Char:
      return ncclInt8;
    case c10::ScalarType::Bool:
      return ncclUint8;
    default:
      return ncclNumTypes;
  }
}

// Integers are averaged as a sum followed by a truncating division (the CPU backends' rule).
ncclRedOp_t nccl_op(ReduceOp op, c10::ScalarType t) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return is_float(t) ? ncclAvg : ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

void divide_avg_if_needed(at::Tensor t, ReduceOp op, int n) {
  if (op == ReduceOp::kAvg && !is_float(t.scalar_type())) t.div_(n, "trunc");
}

void check_dtype(const CommBase& c, const char* op, const at::Tensor& t, bool reduces) {
  PARALLAX_CHECK(nccl_type(t.scalar_type()) != ncclNumTypes, CommError,
                 "{} on group '{}' (rank {}): dtype {} is not supported by the nccl backend", op,
                 c.name(), c.rank(), c10::toString(t.scalar_type()));
  PARALLAX_CHECK(!reduces || t.scalar_type() != c10::ScalarType::Bool, CommError,
                 "{} on group '{}' (rank {}): bool tensors cannot be reduced", op, c.name(),
                 c.rank());
}

std::string nccl_error(ncclResult_t rc, ncclComm_t comm) {
  const char* last = comm ? ncclGetLastError(comm) : nullptr;
  return fmt::format("{} ({}){}", ncclGetErrorString(rc), static_cast<int>(rc),
                     last && *last ? fmt::format(": {}", last) : std::string());
}

// Polls a non-blocking communicator until its pending call finished (ncclSuccess), it failed
// (CommError) or `deadline` passed (TimeoutError).
void wait_ready(ncclComm_t comm, Clock::time_point deadline, const std::string& what) {
  int spins = 0;
  Clock::time_point first{};
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
    if (rc != ncclSuccess)
      throw CommError(fmt::format("{}: ncclCommGetAsyncError: {}", what, nccl_error(rc, comm)));
    if (state == ncclSuccess) return;
    if (state != ncclInProgress)
      throw CommError(fmt::format("{}: {}", what, nccl_error(state, comm)));
    const auto now = Clock::now();
    if (now > deadline)
      throw TimeoutError(fmt::format("{}: not finished before the deadline", what));
    // A non-blocking communicator usually finishes enqueueing within microseconds: spin (yielding)
    // for the first 2 ms, then back off. A fixed sleep here cost ~200 us per collective and made
    // the ring, which enqueues one group per step and column, latency-bound.
    if (spins++ == 0) first = now;
    if (now - first < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

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

// NCCL connects a collective's peers on first use by default (NCCL_RUNTIME_CONNECT=1). On a
// blocking communicator that first use would wait for a missing peer inside NCCL with the host
// blocked, out of reach of timeout_s. With NCCL_RUNTIME_CONNECT=0 every communicator connects its
// ring and tree peers while it is created, which the non-blocking creation path bounds by
// init_timeout_s. NCCL reads the variable once per process, before its first communicator, so it
// is set here unless the user set it.
void connect_at_creation(int rank) {
  const char* user = std::getenv("NCCL_RUNTIME_CONNECT");
  if (user) {
    if (std::string(user) != "0") {
      core::log::warn(
          "world rank {}: NCCL_RUNTIME_CONNECT={} with blocking NCCL communicators "
          "(parallel.nccl_blocking): a collective's first contact with a rank that never arrives "
          "can block past timeout_s",
          rank, user);
    }
    return;
  }
  ::setenv("NCCL_RUNTIME_CONNECT", "0", 0);
}

Clock::time_point after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Every group has a non-blocking control communicator, through which creation and split honour
// their deadlines, and which carries point-to-point traffic (its first contact with a peer
// connects lazily, and only non-blocking mode lets that wait time out). With
// CommOptions::nccl_blocking (the default) collectives run on a blocking twin split from it:
// NCCL's non-blocking enqueue costs ~100 us per collective against ~30 us (measured on
// 2 x H200, docs/comm.md). The twin's collective connections are made while it is created
// (NCCL_RUNTIME_CONNECT=0, see make_nccl_world), under the creation deadline, so no collective
// on it has to wait for a peer on the host.
ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// The blocking data-path twin of the non-blocking `ctrl` (collective over ctrl's ranks).
// Throws TimeoutError/CommError; `what` names the group for the message.
ncclComm_t make_blocking_twin(ncclComm_t ctrl, int rank, Clock::time_point deadline, const std::string& what) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t twin = nullptr;
  ncclResult_t rc = ncclCommSplit(ctrl, 0, rank, &twin, &config);
  try {
    if (rc != ncclSuccess && rc != ncclInProgress)
      throw CommError(fmt::format("ncclCommSplit ({} data path): {}", what, nccl_error(rc, ctrl)));
    wait_ready(ctrl, deadline, "ncclCommSplit (" + what + " data path)");
    if (twin) wait_ready(twin, deadline, "ncclCommSplit (" + what + " data path, new communicator)");
  } catch (...) {
    if (twin) ncclCommAbort(twin);
    throw;
  }
  PARALLAX_CHECK(twin != nullptr, CommError, "ncclCommSplit ({} data path) returned no communicator", what);
  return twin;
}

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
                   std::vector<int> world_ranks, CommOptions options)
      : CommBase(std::move(ctx), std::move(name), std::move(uid), rank, std::move(world_ranks),
                 options),
        comm_(comm),
        ctrl_(ctrl),
        device_(device),
        stream_(c10::cuda::getStreamFromPool(true, device.index())),
        reduce_stream_(c10::cuda::getStreamFromPool(true, device.index())) {
    if (ctx_->board) {
      try {
        ctx_->board->publish_now(uid_, 0, "created");
      } catch (const std::exception& e) {
        core::log::warn("group '{}': could not publish to the hang-report store: {}", name_,
                        e.what());
      }
    }
    watchdog_ = std::thread([this] { watchdog(); });
  }

  ~NcclCommunicator() override {
    ctx_->unregister_comm(this);
    release_backend();
  }

  std::string backend() const override { return "nccl"; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CUDA; }
  const c10::Device& device() const { return device_; }

  // ---- ops -----------------------------------------------------------------------------------

  WorkPtr all_reduce_async(at::Tensor& tensor, ReduceOp op, CallSite site) override {
    return all_reduce_async(tensor, op, options_.allreduce_algo, site);
  }

  WorkPtr all_reduce_async(at::Tensor& tensor, ReduceOp op, AllReduceAlgo algo,
                           CallSite site) override {
    check_cuda(*this, "all_reduce", tensor);
    check_dtype(*this, "all_reduce", tensor, true);
    OpDesc d = tensor_desc(OpKind::kAllReduce, tensor, site);
    d.reduce = op;
    d.algo = algo;
    Ticket t = begin(d);
    const int n = size();
    if (n == 1 || tensor.numel() == 0) {
      complete(t);
      return std::make_shared<DoneWork>();
    }
    at::Tensor target = tensor;
    if (algo == AllReduceAlgo::kRing) connect_ring_peers(t);
    return enqueue({t}, {target}, [&] { reduce_in_place(target, op, algo, t); });
  }

  // The wire copy is made, reduced and cast back on the comm stream, so both casts overlap the
  // caller's work (DDP: the rest of backward). ncclAvg on a floating type multiplies by 1/n before
  // summing (NCCL's PreMulSum).
  WorkPtr all_reduce_compressed_async(at::Tensor& tensor, ReduceOp op, at::ScalarType wire,
                                      AllReduceAlgo algo, CallSite site) override {
    check_cuda(*this, "all_reduce", tensor);
    check_wire_dtype(*this, tensor, wire);
    if (wire == tensor.scalar_type()) return all_reduce_async(tensor, op, algo, site);
    PARALLAX_CHECK(nccl_type(wire) != ncclNumTypes, CommError,
                   "all_reduce_compressed on group '{}' (rank {}): wire dtype {} is not supported by the nccl backend",
                   name_, rank_, c10::toString(wire));
    OpDesc d = tensor_desc(OpKind::kAllReduce, tensor, site);
    d.dtype = wire;  // what travels, and what the debug check compares across ranks
    d.reduce = op;
    d.algo = algo;
    Ticket t = begin(d);
    if (size() == 1 || tensor.numel() == 0) {
      complete(t);
      return std::make_shared<DoneWork>();
    }
    at::Tensor target = tensor;
    if (algo == AllReduceAlgo::kRing) connect_ring_peers(t);
    return enqueue({t}, {target}, [&] {
      at::Tensor copy = target.to(wire);
      reduce_in_place(copy, op, algo, t);
      target.copy_(copy);
    });
  }

  // One ticket for the whole group (one flight-recorder entry, one sequence number), so a
  // 150-tensor DDP step costs the host 14 ticket/event pairs rather than 150.
  WorkPtr all_reduce_coalesced_async(std::vector<at::Tensor>& tensors, ReduceOp op,
                                     CallSite site) override {
    if (tensors.empty()) return std::make_shared<DoneWork>();
    const auto dtype = tensors.front().scalar_type();
    int64_t total = 0;
    for (const auto& t : tensors) {
      check_cuda(*this, "all_reduce_coalesced", t, /*contiguous=*/false);
      check_dtype(*this, "all_reduce_coalesced", t, true);
      // Mixed dtypes: one flat buffer per dtype (the default), each a single all-reduce.
      if (t.scalar_type() != dtype) return Communicator::all_reduce_coalesced_async(tensors, op, site);
      total += t.numel();
    }
    OpDesc d = tensor_desc(OpKind::kAllReduce, tensors.front(), site);
    d.reduce = op;
    d.shape = {total};
    d.numel = d.match_numel = total;
    d.tensors = static_cast<int>(tensors.size());
    Ticket t = begin(d);
    const int n = size();
    if (n == 1 || total == 0) {
      complete(t);
      return std::make_shared<DoneWork>();
    }
    return enqueue({t}, tensors, [&] {
      // A tensor whose elements are not one dense block (a strided view) is reduced through a
      // contiguous copy; gradients and parameters always are dense.
      std::vector<at::Tensor> targets;
      for (const auto& x : tensors) {
        targets.push_back(x.is_non_overlapping_and_dense() ? x : x.contiguous());
      }
      group_start(t);
      for (auto& x : targets) {
        if (x.numel() == 0) continue;
        call(ncclAllReduce(x.data_ptr(), x.data_ptr(), static_cast<size_t>(x.numel()), nccl_type(dtype),
                           nccl_op(op, dtype), comm_, stream_.stream()),
             "ncclAllReduce", t);
      }
      group_end(t, comm_);
      for (std::size_t i = 0; i < targets.size(); ++i) {
        divide_avg_if_needed(targets[i], op, n);
        if (!targets[i].is_same(tensors[i])) tensors[i].copy_(targets[i]);
      }
    });
  }

  WorkPtr reduce_scatter_async(const at::Tensor& input, at::Tensor& output, ReduceOp op,
                               CallSite site) override {
    check_cuda(*this, "reduce_scatter", input);
    check_cuda(*this, "reduce_scatter", output);
    check_dtype(*this, "reduce_scatter", input, true);
    const int n = size();
    const int64_t m = input.numel();
    check_reduce_scatter_shapes(*this, input, output);
    OpDesc d = tensor_desc(OpKind::kReduceScatter, input, site);
    d.reduce = op;
    Ticket t = begin(d);
    if (m == 0) {
      complete(t);
      return std::make_shared<DoneWork>();
    }
    at::Tensor in = input, out = output;
    return enqueue({t}, {in, out}, [&] {
      const int64_t p = chunk_numel(m, n, 0);
      at::Tensor src = in.view({-1}), dst = out.view({-1});
      if (m % n != 0) {  // NCCL needs equal chunks: pad each to the largest
        at::Tensor padded = at::zeros({n * p}, in.options());
        for (int r = 0; r < n; ++r) {
          padded.narrow(0, r * p, chunk_numel(m, n, r))
              .copy_(src.narrow(0, chunk_offset(m, n, r), chunk_numel(m, n, r)));
        }
        src = padded;
        dst = at::empty({p}, in.options());
      }
      call(ncclReduceScatter(src.data_ptr(), dst.data_ptr(), static_cast<size_t>(p),
                             nccl_type(in.scalar_type()), nccl_op(op, in.scalar_type()), comm_,
                             stream_.stream()),
           "ncclReduceScatter", t);
      divide_avg_if_needed(dst, op, n);
      if (dst.data_ptr() != out.data_ptr()) out.view({-1}).copy_(dst.narrow(0, 0, out.numel()));
    });
  }

  WorkPtr all_gather_async(const at::Tensor& input, at::Tensor& output, CallSite site) override {
    check_cuda(*this, "all_gather", input);
    check_cuda(*this, "all_gather", output);
    check_dtype(*this, "all_gather", input, false);
    const int n = size();
    const int64_t total = output.numel();
    check_all_gather_shapes(*this, input, output);
    OpDesc d = tensor_desc(OpKind::kAllGather, input, site);
    d.match_numel = total;
    Ticket t = begin(d);
    if (total == 0) {
      complete(t);
      return std::make_shared<DoneWork>();
    }
    at::Tensor in = input, out = output;
    return enqueue({t}, {in, out}, [&] {
      if (total % n == 0) {  // equal chunks: straight into the output (in place when `in` is our chunk)
        call(ncclAllGather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(total / n),
                           nccl_type(in.scalar_type()), comm_, stream_.stream()),
             "ncclAllGather", t);
        return;
      }
      // Uneven chunks only: the per-rank views of the output (their construction is host time on
      // every call, which the even path, the common one, does not need).
      std::vector<int64_t> sizes;
      std::vector<at::Tensor> outs;
      for (int r = 0; r < n; ++r) {
        sizes.push_back(chunk_numel(total, n, r));
        outs.push_back(out.view({-1}).narrow(0, chunk_offset(total, n, r), sizes.back()));
      }
      gather_padded(in, sizes, outs, t);
    });
  }

  WorkPtr all_gather_async(const at::Tensor& input, std::vector<at::Tensor>& outputs,
                           CallSite site) override {
    check_cuda(*this, "all_gather", input);
    check_dtype(*this, "all_gather", input, false);
    const int64_t total = check_all_gather_list_shapes(*this, input, outputs);
    std::vector<int64_t> sizes;
    std::vector<at::Tensor> outs;
    for (auto& o : outputs) {
      check_cuda(*this, "all_gather", o);
      sizes.push_back(o.numel());
      outs.push_back(o.view({-1}));
    }
    OpDesc d = tensor_desc(OpKind::kAllGatherList, input, site);
    d.match_numel = total;
    Ticket t = begin(d);
    if (total == 0) {
      complete(t);
      return std::make_shared<DoneWork>();
    }
    std::vector<at::Tensor> keep = outputs;
    keep.push_back(input);
    at::Tensor in = input;
    return enqueue({t}, keep, [&] { gather_padded(in, sizes, outs, t); });
  }

  WorkPtr broadcast_async(at::Tensor& tensor, int root, CallSite site) override {
    check_cuda(*this, "broadcast", tensor);
    check_dtype(*this, "broadcast", tensor, false);
    PARALLAX_CHECK(root >= 0 && root < size(), CommError,
                   "broadcast on group '{}' (rank {}): root {} is not a rank of {}", name_, rank_,
                   root, size());
    OpDesc d = tensor_desc(OpKind::kBroadcast, tensor, site);
    d.root = root;
    Ticket t = begin(d);
    if (size() == 1 || tensor.numel() == 0) {
      complete(t);
      return std::make_shared<DoneWork>();
    }
    at::Tensor x = tensor;
    return enqueue({t}, {x}, [&] {
      call(ncclBroadcast(x.data_ptr(), x.data_ptr(), static_cast<size_t>(x.numel()),
                         nccl_type(x.scalar_type()), root, comm_, stream_.stream()),
           "ncclBroadcast", t);
    });
  }

  WorkPtr send_async(const at::Tensor& tensor, int peer, int tag, CallSite site) override {
    std::vector<P2POp> ops{{P2POp::Kind::kSend, tensor, peer, tag}};
    return batch_isend_irecv(ops, site);
  }

  WorkPtr recv_async(at::Tensor& tensor, int peer, int tag, CallSite site) override {
    std::vector<P2POp> ops{{P2POp::Kind::kRecv, tensor, peer, tag}};
    return batch_isend_irecv(ops, site);
  }

  WorkPtr batch_isend_irecv(std::vector<P2POp>& ops, CallSite site) override {
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
      OpDesc d = tensor_desc(op.kind == P2POp::Kind::kSend ? OpKind::kSend : OpKind::kRecv,
                             op.tensor, site);
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

  WorkPtr barrier_async(BarrierKind kind, CallSite site) override {
    OpDesc d;
    d.kind = OpKind::kBarrier;
    d.barrier = kind;
    d.site = site;
    Ticket t = begin(d);
    if (size() == 1) {
      complete(t);
      return std::make_shared<DoneWork>();
    }
    // NCCL has no barrier: a one-element all-reduce, which completes only when every rank issued
    // it.
    if (!barrier_buf_.defined()) {
      c10::cuda::CUDAGuard g(device_);
      barrier_buf_ = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(device_));
    }
    at::Tensor b = barrier_buf_;
    return enqueue({t}, {b}, [&] {
      call(
          ncclAllReduce(b.data_ptr(), b.data_ptr(), 1, ncclInt32, ncclSum, comm_, stream_.stream()),
          "ncclAllReduce", t);
    });
  }

  void release_backend() noexcept override {
    if (released_) return;
    released_ = true;
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      stop_ = true;
    }
    watchdog_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    if (comm_aborted_ || !comm_) return;
    // Graceful: let enqueued work drain (bounded), finalize, destroy; abort if any step fails.
    try {
      c10::cuda::CUDAGuard g(device_);
      const auto deadline = after(options_.timeout_s);
      while (cudaStreamQuery(stream_.stream()) == cudaErrorNotReady) {
        if (Clock::now() > deadline) throw TimeoutError("comm stream did not drain");
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ncclResult_t rc = ncclCommFinalize(comm_);
      if (rc != ncclSuccess && rc != ncclInProgress) throw CommError(nccl_error(rc, comm_));
      wait_ready(comm_, after(options_.init_timeout_s), "ncclCommFinalize");
      ncclCommDestroy(comm_);
      comm_ = nullptr;
      if (ctrl_) {
        rc = ncclCommFinalize(ctrl_);
        if (rc != ncclSuccess && rc != ncclInProgress) throw CommError(nccl_error(rc, ctrl_));
        wait_ready(ctrl_, after(options_.init_timeout_s), "ncclCommFinalize (control)");
        ncclCommDestroy(ctrl_);
        ctrl_ = nullptr;
      }
    } catch (const std::exception& e) {
      core::log::warn("group '{}': NCCL communicator did not shut down cleanly ({}); aborting it",
                      name_, e.what());
      if (comm_) ncclCommAbort(comm_);
      if (ctrl_) ncclCommAbort(ctrl_);
    }
    comm_ = nullptr;
    ctrl_ = nullptr;
  }

  // Called by a wait whose deadline passed (main thread) or by the watchdog.
  [[noreturn]] void timeout(const std::shared_ptr<Pending>& p) {
    std::lock_guard<std::mutex> lock(fail_mu_);
    if (aborted_) {
      if (p->timed_out) throw TimeoutError(failure_message());
      throw CommError(failure_message());
    }
    p->timed_out = true;
    fail_timeout(p->tickets[0]);
  }

  [[noreturn]] void rethrow_failure(const std::shared_ptr<Pending>& p) {
    if (p->timed_out) throw TimeoutError(failure_message());
    check_usable("wait");
    throw CommError(failure_message());
  }

  void mark_completed(const std::shared_ptr<Pending>& p) {
    if (p->completed.exchange(true) || p->internal) return;
    for (const auto& t : p->tickets) complete(t);
  }

 protected:
  std::vector<std::vector<uint8_t>> allgather_bytes(const std::vector<uint8_t>& mine,
                                                    const Ticket& t) override {
    const int n = size();
    const int64_t len = static_cast<int64_t>(mine.size());
    c10::cuda::CUDAGuard g(device_);
    at::Tensor host = at::empty({len}, at::kByte);
    std::memcpy(host.data_ptr(), mine.data(), mine.size());
    at::Tensor in = host.to(device_);
    at::Tensor out = at::empty({n * len}, in.options());
    auto w = enqueue(
        {t}, {in, out},
        [&] {
          call(ncclAllGather(in.data_ptr(), out.data_ptr(), static_cast<size_t>(len), ncclUint8,
                             comm_, stream_.stream()),
               "ncclAllGather", t);
        },
        /*record=*/false);
    w->wait();
    at::Tensor all = out.cpu();
    std::vector<std::vector<uint8_t>> res(static_cast<size_t>(n));
    const auto* p = all.data_ptr<uint8_t>();
    for (int r = 0; r < n; ++r) res[static_cast<size_t>(r)].assign(p + r * len, p + (r + 1) * len);
    return res;
  }

  std::shared_ptr<CommBase> create_child(int color, const std::vector<int>& members,
                                         const std::string& name, const std::string& uid,
                                         const Ticket& t) override {
    int key = 0;
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i] == rank_) key = static_cast<int>(i);
    }
    c10::cuda::CUDAGuard g(device_);
    ncclConfig_t config = nonblocking_config();
    ncclComm_t parent = ctrl_ ? ctrl_ : comm_;
    ncclComm_t child = nullptr, twin = nullptr;
    try {
      ncclResult_t rc =
          ncclCommSplit(parent, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &config);
      if (rc != ncclSuccess && rc != ncclInProgress)
        throw CommError(fmt::format("ncclCommSplit: {}", nccl_error(rc, parent)));
      wait_ready(parent, t.deadline, "ncclCommSplit (parent)");
      if (child) wait_ready(child, t.deadline, "ncclCommSplit (new communicator)");
      if (child && options_.nccl_blocking) twin = make_blocking_twin(child, key, t.deadline, name);
    } catch (const TimeoutError&) {
      if (child) ncclCommAbort(child);
      fail_timeout(t, " (in ncclCommSplit)");
    } catch (const std::exception& e) {
      if (child) ncclCommAbort(child);
      fail_error(t, e.what());
    }
    if (color < 0 || !child) return nullptr;
    std::vector<int> wr;
    for (int m : members) wr.push_back(world_ranks_[static_cast<size_t>(m)]);
    return std::make_shared<NcclCommunicator>(ctx_, twin ? twin : child, twin ? child : nullptr,
                                              device_, name, uid, key, std::move(wr), options_);
  }

  void abort_backend() noexcept override {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (comm_ && !comm_aborted_) {
      ncclCommAbort(comm_);
      if (ctrl_) ncclCommAbort(ctrl_);
      comm_aborted_ = true;
    }
  }

 private:
  static void check_cuda(const CommBase& c, const char* op, const at::Tensor& t, bool contiguous = true) {
    check_tensor(c, op, t, c10::DeviceType::CUDA, contiguous);
    const auto& me = static_cast<const NcclCommunicator&>(c);
    PARALLAX_CHECK(t.device() == me.device_, CommError,
                   "{} on group '{}' (rank {}): tensor on {} but the communicator uses {}", op,
                   c.name(), c.rank(), t.device().str(), me.device_.str());
  }

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
      if (rc != cudaSuccess) throw CommError(fmt::format("cudaStreamIsCapturing: {}", cudaGetErrorString(rc)));
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
  void connect_ring_peers(const Ticket& t) {
    if (!ctrl_ || ring_peers_ready_) return;
    allgather_bytes(std::vector<uint8_t>{1}, t);
    ring_peers_ready_ = true;
  }
  ncclComm_t ring_comm() const { return ring_peers_ready_ ? comm_ : p2p_comm(); }

  // `comm`: the communicator the call was made on (nullptr: comm_).
  void call(ncclResult_t rc, const char* what, const Ticket& t, ncclComm_t comm = nullptr) {
    if (!comm) comm = comm_;
    if (rc == ncclSuccess) return;
    if (rc == ncclInProgress) {
      wait_ready(comm, t.deadline, what);
      return;
    }
    throw CommError(fmt::format("{}: {}", what, nccl_error(rc, comm)));
  }
  void group_start(const Ticket& t) { call(ncclGroupStart(), "ncclGroupStart", t); }
  void group_end(const Ticket& t, ncclComm_t comm) {
    call(ncclGroupEnd(), "ncclGroupEnd", t, comm);
  }

  // One all-reduce of a contiguous tensor, on the comm stream (inside enqueue()'s body).
  void reduce_in_place(at::Tensor& x, ReduceOp op, AllReduceAlgo algo, const Ticket& t) {
    if (algo == AllReduceAlgo::kRing) {
      ring(x.view({-1}), op, t);
      return;
    }
    call(ncclAllReduce(x.data_ptr(), x.data_ptr(), static_cast<size_t>(x.numel()), nccl_type(x.scalar_type()),
                       nccl_op(op, x.scalar_type()), comm_, stream_.stream()),
         "ncclAllReduce", t);
    divide_avg_if_needed(x, op, size());
  }

  // All-gather of pieces of sizes[r] elements into outs[r], each padded to the largest.
  void gather_padded(const at::Tensor& in, const std::vector<int64_t>& sizes,
                     std::vector<at::Tensor>& outs, const Ticket& t) {
    const int n = size();
    const int64_t p = *std::max_element(sizes.begin(), sizes.end());
    at::Tensor src = at::zeros({p}, in.options());
    src.narrow(0, 0, in.numel()).copy_(in.view({-1}));
    at::Tensor dst = at::empty({n * p}, in.options());
    call(ncclAllGather(src.data_ptr(), dst.data_ptr(), static_cast<size_t>(p),
                       nccl_type(in.scalar_type()), comm_, stream_.stream()),
         "ncclAllGather", t);
    for (int r = 0; r < n; ++r)
      outs[static_cast<size_t>(r)].copy_(dst.narrow(0, r * p, sizes[static_cast<size_t>(r)]));
  }

  // Ring all-reduce with ncclSend/ncclRecv inside ncclGroupStart/End per step and column.
  // Transfers run on the comm stream; with several columns the reductions run on a second stream
  // and per-column events let column c+1 transfer while column c is reduced (see ring.h for the
  // schedule); one column stays on the comm stream.
  void ring(at::Tensor flat, ReduceOp op, const Ticket& t) {
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

  void watchdog() {
    try {
      c10::cuda::CUDAGuard g(device_);
      std::unique_lock<std::mutex> lock(pending_mu_);
      while (!stop_) {
        watchdog_cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; });
        if (stop_) break;
        std::vector<std::shared_ptr<Pending>> list(pending_.begin(), pending_.end());
        lock.unlock();
        std::vector<Pending*> done;
        for (auto& p : list) {
          if (p->completed || p->end->query()) {
            mark_completed(p);
            done.push_back(p.get());
          } else if (Clock::now() > p->tickets[0].deadline && !aborted_) {
            try {
              timeout(p);
            } catch (const std::exception&) {
              // Reported (log, flight recorder, aborted communicator); the waiter rethrows it.
            }
          }
        }
        for (ncclComm_t c : {comm_, ctrl_}) {
          if (aborted_ || !c || comm_aborted_ || list.empty()) break;
          ncclResult_t state = ncclSuccess;
          if (ncclCommGetAsyncError(c, &state) == ncclSuccess && state != ncclSuccess &&
              state != ncclInProgress) {
            std::lock_guard<std::mutex> fl(fail_mu_);
            if (!aborted_) {
              try {
                fail_error(list.front()->tickets[0],
                           fmt::format("asynchronous NCCL error: {}", nccl_error(state, c)));
              } catch (const std::exception&) {
              }
            }
          }
        }
        lock.lock();
        pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                      [&](const std::shared_ptr<Pending>& p) {
                                        return std::find(done.begin(), done.end(), p.get()) !=
                                                   done.end() ||
                                               aborted_;
                                      }),
                       pending_.end());
      }
    } catch (const std::exception& e) {
      core::log::error("group '{}': NCCL watchdog stopped: {}", name_, e.what());
    }
  }

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

bool NcclWork::poll() {
  PARALLAX_CHECK(!p_->captured, CommError,
                 "group '{}' (rank {}): a collective captured into a CUDA graph has no completion to wait for on the "
                 "host (it runs when the graph is replayed); use wait_stream()",
                 comm_->name(), comm_->rank());
  if (p_->completed) return true;
  if (comm_->aborted()) comm_->rethrow_failure(p_);
  c10::cuda::CUDAGuard g(comm_->device());
  if (p_->end->query()) {
    comm_->mark_completed(p_);
    return true;
  }
  if (Clock::now() > p_->tickets[0].deadline) comm_->timeout(p_);
  return false;
}

void NcclWork::wait() {
  // Spin (yielding) for the first millisecond, then poll every 20 us: a fixed 50 us sleep added up
  // to 50 us to every blocking collective.
  const auto start = Clock::now();
  while (!poll()) {
    if (Clock::now() - start < std::chrono::milliseconds(1)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  wait_stream();
}

void NcclWork::wait_stream() {
  if (comm_->aborted() && !p_->completed) comm_->rethrow_failure(p_);
  c10::cuda::CUDAGuard g(comm_->device());
  p_->end->block(c10::cuda::getCurrentCUDAStream(comm_->device().index()));
}

bool NcclWork::is_completed() {
  return poll();
}

}  // namespace

CommPtr make_nccl_world(const std::shared_ptr<WorldContext>& ctx, const CommOptions& options) {
  PARALLAX_CHECK(ctx->device.has_value(), CommError,
                 "backend 'nccl' needs a CUDA device on world rank {}", ctx->rank);
  PARALLAX_CHECK(
      ctx->launch.local_world_size <= ctx->cuda_devices, CommError,
      "backend 'nccl': {} ranks on this node but only {} GPUs (world rank {}, local rank {})",
      ctx->launch.local_world_size, ctx->cuda_devices, ctx->rank, ctx->launch.local_rank);
  const c10::Device device = *ctx->device;
  c10::cuda::CUDAGuard g(device);
  if (options.nccl_blocking) connect_at_creation(ctx->rank);
  const std::string uid = ctx->next_world_uid("nccl");
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  std::vector<uint8_t> bytes(sizeof(id));
  if (ctx->rank == 0) {
    ncclResult_t rc = ncclGetUniqueId(&id);
    PARALLAX_CHECK(rc == ncclSuccess, CommError, "ncclGetUniqueId failed on world rank 0: {}",
                   nccl_error(rc, nullptr));
    std::memcpy(bytes.data(), &id, sizeof(id));
  }
  bytes = ctx->broadcast_from_root(std::move(bytes), uid + "/nccl_id", options.init_timeout_s);
  PARALLAX_CHECK(bytes.size() == sizeof(id), CommError, "world rank {}: malformed NCCL unique id",
                 ctx->rank);
  std::memcpy(&id, bytes.data(), sizeof(id));
  ncclConfig_t config = nonblocking_config();
  ncclComm_t comm = nullptr;
  ncclResult_t rc = ncclCommInitRankConfig(&comm, ctx->size, id, ctx->rank, &config);
  ncclComm_t twin = nullptr;
  try {
    if (rc != ncclSuccess && rc != ncclInProgress) throw CommError(nccl_error(rc, comm));
    const auto deadline = after(options.init_timeout_s);
    wait_ready(comm, deadline, "ncclCommInitRankConfig");
    if (options.nccl_blocking) twin = make_blocking_twin(comm, ctx->rank, deadline, "world");
  } catch (const std::exception& e) {
    if (comm) ncclCommAbort(comm);
    ctx->failed = true;
    if (dynamic_cast<const TimeoutError*>(&e)) {
      throw_error<TimeoutError>(
          "creating the nccl world communicator timed out after {:.0f} s on world rank {} "
          "(init timeout): not every rank arrived",
          options.init_timeout_s, ctx->rank);
    }
    throw_error<CommError>("creating the nccl world communicator failed on world rank {}: {}",
                           ctx->rank, e.what());
  }
  std::vector<int> ranks(static_cast<size_t>(ctx->size));
  for (int i = 0; i < ctx->size; ++i) ranks[static_cast<size_t>(i)] = i;
  return std::make_shared<NcclCommunicator>(ctx, twin ? twin : comm, twin ? comm : nullptr, device,
                                            "world", uid, ctx->rank, std::move(ranks), options);
}

}  // namespace parallax::parallel::comm::detail

#endif  // PARALLAX_WITH_NCCL
