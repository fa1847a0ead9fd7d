// The one communication interface every parallel engine uses (DDP, ZeRO, TP, PP, checkpoints).
//
// A Communicator is a group of ranks (the world, or a `split` of it: tp, dp, pp, dp x tp) bound
// to one backend: `mpi` (CPU tensors) or `nccl` (CUDA tensors). Every collective has an async
// form returning a Work handle; the blocking form is `async(...)->wait()`. Every wait has a
// deadline (CommOptions); on expiry the rank throws TimeoutError naming the op, the group, the
// peer ranks that never arrived (from the flight recorder) and the tensor size, instead of
// hanging.
//
// Contracts:
// - Collective calls on one Communicator must be issued in the same order on every member rank
//   (as with MPI and NCCL). `CommOptions::debug_collectives` checks this at run time.
// - A Communicator is used from one thread at a time (the training thread); Work handles may be
//   waited on from that thread only. Backends may run progress/watchdog threads internally.
// - Tensors must be contiguous and stay alive and unmodified until their Work completes.
// - After a TimeoutError or CommError the communicator is unusable (aborted); create a new one.
// - Every op takes the caller's source location as a defaulted last argument (`site`); it is
//   recorded by the flight recorder and named in mismatch and timeout errors. Callers never pass it
//   explicitly unless they forward their own caller's location.
// - User send/recv tags must lie in [0, kMaxUserTag); larger tags are reserved for the ring.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>

#include <cstdint>
#include <memory>
#include <source_location>
#include <string>
#include <vector>

namespace parallax::comm {

enum class ReduceOp { kSum, kAvg, kMax, kMin };
enum class AllReduceAlgo { kNative, kRing };

const char* to_string(ReduceOp op);
const char* to_string(AllReduceAlgo algo);
// "native" | "ring"; throws ConfigError naming the value otherwise.
AllReduceAlgo parse_allreduce_algo(const std::string& name);

// The caller's file, line and function, captured by default arguments.
using CallSite = std::source_location;
// "file.cpp:123 (function)", with the file reduced to its last two path components.
std::string format_site(const CallSite& site);

// User tags of send/recv must be below this; the tags above are the ring algorithm's.
inline constexpr int kMaxUserTag = 1 << 20;

struct CommOptions {
  double timeout_s = 600;              // steady-state collectives
  double init_timeout_s = 300;         // communicator creation, rendezvous, split
  double checkpoint_timeout_s = 1800;  // barrier(kCheckpoint)
  bool debug_collectives = false;      // cross-check op/shape/dtype across ranks before each op
  int flight_recorder_size = 512;      // ops (collectives and p2p) remembered per communicator
  AllReduceAlgo allreduce_algo = AllReduceAlgo::kNative;
  // Pipelining granularity of the ring algorithm; 0: the backend's default (4 MiB on the CPU
  // backends; 1 GiB on NCCL, where one send/recv group per step measured fastest on NVLink).
  int64_t ring_chunk_bytes = 0;
  // NCCL: collectives on communicators in NCCL's blocking mode (cheaper per small collective than
  // non-blocking enqueue; figures in docs/PERFORMANCE.md). Creation and split go through a
  // non-blocking control communicator, so init_timeout_s holds; every collective connection is
  // made during creation (NCCL_RUNTIME_CONNECT=0 unless the user set it), so no collective waits
  // for a peer on the host; point-to-point traffic (whose connections NCCL always makes on first
  // use) stays on the non-blocking control communicator; a collective whose peers' kernels never
  // come is timed out by the watchdog (ncclCommAbort). false: everything on non-blocking
  // communicators.
  bool nccl_blocking = true;
};

inline int64_t ring_chunk_or(const CommOptions& o, int64_t backend_default) {
  return o.ring_chunk_bytes > 0 ? o.ring_chunk_bytes : backend_default;
}

// Counters for tests and benchmarks (e.g. "no collective before the last micro-step", "the ring
// sends 2(N-1)/N x M bytes").
struct CommStats {
  int64_t collectives = 0;  // ops issued (all_reduce, reduce_scatter, ..., barrier); not send/recv
  int64_t p2p_ops = 0;      // send + recv issued directly or inside the ring algorithm
  int64_t bytes_sent = 0;   // payload bytes this rank sent point-to-point (ring + send)
};

class Work {
 public:
  virtual ~Work() = default;
  // Blocks the host until the op completes or the deadline passes (TimeoutError). For NCCL, also
  // makes the current CUDA stream ordered after the op.
  virtual void wait() = 0;
  // Orders the current device stream after the op without blocking the host (NCCL); a watchdog
  // still enforces the deadline. On CPU backends identical to wait().
  virtual void wait_stream() { wait(); }
  // Non-blocking poll. On CPU backends this is also what drives a pending op forward (the ring
  // algorithm advances its steps here and in wait()). Throws like wait() if the op failed or its
  // deadline has passed.
  virtual bool is_completed() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// Elements of chunk `index` when `numel` elements are split into `parts` contiguous chunks; the
// first numel % parts chunks get one element more. reduce_scatter and all_gather use this split.
int64_t chunk_numel(int64_t numel, int parts, int index);
int64_t chunk_offset(int64_t numel, int parts, int index);

enum class BarrierKind { kDefault, kCheckpoint };

// One message of batch_isend_irecv.
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind = Kind::kSend;
  at::Tensor tensor;
  int peer = 0;
  int tag = 0;
};

// One op as the flight recorder remembers it. `seq` numbers the collectives of one communicator
// (1, 2, ...; identical on every member when calls are consistent); send/recv get seq 0 and are
// told apart by `p2p_seq`.
// kCaptured: recorded into a CUDA graph (NCCL, during capture); it runs with each replay of the
// graph, whose completion the graph's owner bounds (train/cuda_graph.h), not the watchdog.
enum class OpState { kIssued, kCompleted, kTimedOut, kFailed, kCaptured };
const char* to_string(OpState state);

struct FlightEntry {
  uint64_t seq = 0;
  uint64_t p2p_seq = 0;
  std::string op;      // "all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", ...
  std::string group;   // communicator name
  std::string detail;  // "sum, ring", "root 0", "to 3, tag 0", "checkpoint", ...
  std::string dtype;
  std::vector<int64_t> shape;
  int64_t bytes = 0;
  std::vector<int> peers;  // world ranks involved (the group, or the p2p peer)
  std::string site;        // format_site(call site)
  OpState state = OpState::kIssued;
  double issued_at = 0;    // seconds since the epoch
  double finished_at = 0;  // 0 while issued
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;  // rank inside this group
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;              // "world", "tp", "dp", "pp", ...
  virtual const std::vector<int>& world_ranks() const = 0;  // world rank of each member
  virtual std::string backend() const = 0;                  // "mpi" | "nccl" | "gloo"
  virtual c10::DeviceType device_type() const = 0;          // kCPU for mpi and gloo, kCUDA for nccl
  virtual const CommOptions& options() const = 0;
  virtual const CommStats& stats() const = 0;

  // In place. kAvg divides by size() after summing. `algo` defaults to options().allreduce_algo.
  virtual WorkPtr all_reduce_async(at::Tensor& tensor, ReduceOp op,
                                   CallSite site = CallSite::current()) = 0;
  virtual WorkPtr all_reduce_async(at::Tensor& tensor, ReduceOp op, AllReduceAlgo algo,
                                   CallSite site = CallSite::current()) = 0;
  // Each tensor all-reduced in place (backend-native algorithm), issued and completed as one unit.
  // NCCL runs one all-reduce per tensor inside one ncclGroupStart/End: no flat staging copy (DDP's
  // grouped buckets use it). The default flattens the tensors of each dtype into one buffer,
  // all-reduces that, and copies the result back when the op completes (wait/is_completed).
  virtual WorkPtr all_reduce_coalesced_async(std::vector<at::Tensor>& tensors, ReduceOp op,
                                             CallSite site = CallSite::current());
  // All-reduce in place through a copy in the narrower floating dtype `wire` (gradient
  // compression, as PyTorch DDP's bf16_compress_hook/fp16_compress_hook or DeepSpeed's
  // communication_data_type): half the bytes for bf16/fp16 copies of fp32 tensors. The result is
  // the reduction of the ranks' wire copies, rounded to `wire`, cast back into `tensor`; kAvg
  // scales before summing where the backend sums in `wire` (NCCL), so fp16 overflows no sooner than
  // fp32 would. NCCL casts on its comm stream, overlapping the caller's work; the default casts on
  // the caller's stream and copies back at completion (wait/wait_stream/is_completed).
  // `wire` equal to the tensor's dtype is a plain all-reduce. CommError if `tensor` is not
  // floating or `wire` is wider than it.
  virtual WorkPtr all_reduce_compressed_async(at::Tensor& tensor, ReduceOp op, at::ScalarType wire,
                                              AllReduceAlgo algo,
                                              CallSite site = CallSite::current());
  // `input` (numel M, any shape) is reduced across ranks; this rank receives chunk rank() of the
  // flattened result (chunk_numel(M, size(), rank()) elements) in `output`.
  virtual WorkPtr reduce_scatter_async(const at::Tensor& input, at::Tensor& output, ReduceOp op,
                                       CallSite site = CallSite::current()) = 0;
  // Every rank contributes `input`; `output` (flat, sum of all inputs' numel) receives rank r's
  // input at chunk_offset(total, size, r). Inputs may differ by one element (uneven split).
  virtual WorkPtr all_gather_async(const at::Tensor& input, at::Tensor& output,
                                   CallSite site = CallSite::current()) = 0;
  // Same, into one tensor per rank (each shaped like that rank's input).
  virtual WorkPtr all_gather_async(const at::Tensor& input, std::vector<at::Tensor>& outputs,
                                   CallSite site = CallSite::current()) = 0;
  virtual WorkPtr broadcast_async(at::Tensor& tensor, int root,
                                  CallSite site = CallSite::current()) = 0;
  virtual WorkPtr send_async(const at::Tensor& tensor, int peer, int tag = 0,
                             CallSite site = CallSite::current()) = 0;
  virtual WorkPtr recv_async(at::Tensor& tensor, int peer, int tag = 0,
                             CallSite site = CallSite::current()) = 0;
  virtual WorkPtr barrier_async(BarrierKind kind = BarrierKind::kDefault,
                                CallSite site = CallSite::current()) = 0;
  // Issues several sends and receives as one unit and completes when all have. Use it for
  // exchanges where a rank both sends and receives (pipeline stages, halo swaps): NCCL runs them
  // inside one ncclGroupStart/End, where separate send()/recv() calls would serialise on the comm
  // stream and deadlock. NCCL ignores tags (messages between two ranks match in issue order); mpi
  // and gloo match them by tag. The default issues send_async/recv_async in order.
  virtual WorkPtr batch_isend_irecv(std::vector<P2POp>& ops, CallSite site = CallSite::current());

  // Collective over this group: ranks with the same `color` form a new group ordered by `key`
  // (then by rank). color < 0: this rank joins no group and gets nullptr. `name` labels the group
  // in errors and the flight recorder.
  virtual std::shared_ptr<Communicator> split(int color, int key, const std::string& name,
                                              CallSite site = CallSite::current()) = 0;

  // Blocking forms.
  void all_reduce(at::Tensor& t, ReduceOp op, CallSite site = CallSite::current()) {
    all_reduce_async(t, op, site)->wait();
  }
  void all_reduce(at::Tensor& t, ReduceOp op, AllReduceAlgo a,
                  CallSite site = CallSite::current()) {
    all_reduce_async(t, op, a, site)->wait();
  }
  void all_reduce_coalesced(std::vector<at::Tensor>& ts, ReduceOp op,
                            CallSite site = CallSite::current()) {
    all_reduce_coalesced_async(ts, op, site)->wait();
  }
  void all_reduce_compressed(at::Tensor& t, ReduceOp op, at::ScalarType wire, AllReduceAlgo a,
                             CallSite site = CallSite::current()) {
    all_reduce_compressed_async(t, op, wire, a, site)->wait();
  }
  void reduce_scatter(const at::Tensor& in, at::Tensor& out, ReduceOp op,
                      CallSite site = CallSite::current()) {
    reduce_scatter_async(in, out, op, site)->wait();
  }
  void all_gather(const at::Tensor& in, at::Tensor& out, CallSite site = CallSite::current()) {
    all_gather_async(in, out, site)->wait();
  }
  void all_gather(const at::Tensor& in, std::vector<at::Tensor>& outs,
                  CallSite site = CallSite::current()) {
    all_gather_async(in, outs, site)->wait();
  }
  void broadcast(at::Tensor& t, int root, CallSite site = CallSite::current()) {
    broadcast_async(t, root, site)->wait();
  }
  void send(const at::Tensor& t, int peer, int tag = 0, CallSite site = CallSite::current()) {
    send_async(t, peer, tag, site)->wait();
  }
  void recv(at::Tensor& t, int peer, int tag = 0, CallSite site = CallSite::current()) {
    recv_async(t, peer, tag, site)->wait();
  }
  void barrier(BarrierKind kind = BarrierKind::kDefault, CallSite site = CallSite::current()) {
    barrier_async(kind, site)->wait();
  }

  // The flight recorder's entries, oldest first (a thread-safe snapshot).
  virtual std::vector<FlightEntry> flight_entries() const { return {}; }
  // True once a timeout, mismatch or backend error has aborted this communicator.
  virtual bool aborted() const { return false; }
};

using CommPtr = std::shared_ptr<Communicator>;

// all_reduce_compressed's argument check (CommError naming the op, group and rank).
void check_wire_dtype(const Communicator& c, const at::Tensor& t, at::ScalarType wire);

}  // namespace parallax::comm
