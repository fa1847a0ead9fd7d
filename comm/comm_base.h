// Internal: what every backend shares. CommBase checks the ops' arguments, numbers ops, records
// them in the flight recorder, publishes sequence numbers for hang reports, runs the debug
// cross-check, builds timeout and mismatch errors, and implements split() on top of a backend's
// byte all-gather. What an op is lives in op_desc.h; the host-polled Work of the CPU backends in
// poll_work.h. DoneWork is the Work of an op with nothing to move. Not part of the public API.
#pragma once

#include "comm/communicator.h"
#include "comm/flight_recorder.h"
#include "comm/op_desc.h"
#include "comm/world_context.h"

#include <c10/core/ScalarType.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace parallax::comm::detail {

class CommBase : public Communicator, public std::enable_shared_from_this<CommBase> {
 public:
  CommBase(std::shared_ptr<WorldContext> ctx, std::string name, std::string uid, int rank,
           std::vector<int> world_ranks, CommOptions options);
  ~CommBase() override;

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(world_ranks_.size()); }
  const std::string& name() const override { return name_; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }
  const CommOptions& options() const override { return options_; }
  const CommStats& stats() const override { return stats_; }
  std::vector<FlightEntry> flight_entries() const override { return recorder_.snapshot(); }
  bool aborted() const override { return aborted_.load(); }

  std::shared_ptr<Communicator> split(int color, int key, const std::string& name,
                                      CallSite site) override;

  const std::string& uid() const { return uid_; }
  const std::shared_ptr<WorldContext>& ctx() const { return ctx_; }
  CommStats& mutable_stats() { return stats_; }

  // Op lifecycle, used by backends and Work objects.
  Ticket begin(OpDesc desc);
  void complete(const Ticket& t);
  // The op was recorded into a CUDA graph instead of running (flight recorder state "captured").
  void captured(const Ticket& t);
  // Marks the op timed out, asks the store which peers never arrived, dumps the flight recorder,
  // aborts the backend and throws TimeoutError.
  [[noreturn]] void fail_timeout(const Ticket& t, const std::string& where = "");
  // Same for a backend error (CommError).
  [[noreturn]] void fail_error(const Ticket& t, const std::string& what);
  // Throws CommError if the communicator was aborted: the failure itself (TimeoutError for a
  // timeout) if no caller has met it yet, else "aborted by an earlier failure: ...".
  void check_usable(const char* what) const;
  std::string failure_message() const;
  // Called first thing on a backend's own thread (the NCCL watchdog): the failures it finds reach
  // no caller by its throws, so the next check_usable() throws them as they are.
  static void this_thread_is_backends();

  // Frees backend resources (World shutdown); the communicator is unusable afterwards.
  virtual void release_backend() noexcept = 0;

 protected:
  // Every member contributes `mine` (same length); returns all members' bytes by group rank.
  // Polled against t.deadline (fail_timeout on expiry).
  virtual std::vector<std::vector<uint8_t>> allgather_bytes(const std::vector<uint8_t>& mine,
                                                            const Ticket& t) = 0;
  // Creates the communicator of this rank's color. `members` are group ranks of this communicator
  // ordered by (key, rank); `color_index` numbers the colors in ascending order.
  virtual std::shared_ptr<CommBase> create_child(int color, const std::vector<int>& members,
                                                 const std::string& name, const std::string& uid,
                                                 const Ticket& t) = 0;
  // Stops the backend after a timeout/error (ncclCommAbort, abandon MPI requests). noexcept.
  virtual void abort_backend() noexcept = 0;

  // ---- what every backend's ops share -------------------------------------------------------
  // Argument checks throw CommError naming the op, group, rank and offending value, and run before
  // the op is opened: a rejected call is neither numbered nor recorded. Each keeps one order of
  // checks (the first failure is the one reported): input before output, a tensor's placement
  // before its dtype, tensors before sizes, root, peer and tag.

  // `t` is defined, contiguous (when `contiguous`) and where the backend's ops run. The default
  // wants device_type(); a backend bound to one device also checks the index.
  virtual void check_op_tensor(const char* op, const at::Tensor& t, bool contiguous) const;
  // `t`'s dtype can travel through the backend, and be reduced by it when `reduces`.
  virtual void check_op_dtype(const char* op, const at::Tensor& t, bool reduces) const = 0;

  // `op` is "all_reduce", or the name of the all-reduce the caller implements on top of it.
  void check_all_reduce_args(const char* op, const at::Tensor& tensor,
                             bool contiguous = true) const;
  // `output` is this rank's chunk of `input` (chunk_numel over size()).
  void check_reduce_scatter_args(const at::Tensor& input, const at::Tensor& output) const;
  // `input` is this rank's chunk of the flat `output`. Returns output.numel().
  int64_t check_all_gather_args(const at::Tensor& input, const at::Tensor& output) const;
  // One output per rank, each of the input's dtype, this rank's as large as the input. Returns the
  // total number of elements.
  int64_t check_all_gather_args(const at::Tensor& input,
                                const std::vector<at::Tensor>& outputs) const;
  void check_broadcast_args(const at::Tensor& tensor, int root) const;
  // `op` is "send" or "recv"; `peer` is another rank of this group, `tag` a user tag.
  void check_p2p_args(const char* op, const at::Tensor& tensor, int peer, int tag) const;

  // Open an op's ticket: its descriptor, then begin() (sequence number, flight recorder, hang
  // board, debug cross-check). Call them after the argument checks.
  // `kind`: kAllReduce or kReduceScatter (whose `algo` is always native). `wire`: the dtype that
  // travels when it is not the tensor's (all_reduce_compressed).
  Ticket open_reduction(OpKind kind, const at::Tensor& tensor, ReduceOp op, CallSite site,
                        AllReduceAlgo algo = AllReduceAlgo::kNative,
                        c10::ScalarType wire = c10::ScalarType::Undefined);
  // `kind`: kAllGather or kAllGatherList; `total`: the elements gathered over all ranks.
  Ticket open_all_gather(OpKind kind, const at::Tensor& input, int64_t total, CallSite site);
  // `kind`: kBroadcast (`root` the root) or kSend / kRecv (`root` the peer, with its `tag`). A
  // send's bytes count in stats().bytes_sent.
  Ticket open_rooted(OpKind kind, const at::Tensor& tensor, int root, CallSite site, int tag = 0);
  Ticket open_barrier(BarrierKind kind, CallSite site);
  // Completes `t` at once, for an op with nothing to move (size-1 group, empty tensors).
  WorkPtr complete_now(const Ticket& t);

  // Announces this new communicator to the hang-report store (sequence number 0). A store that
  // cannot be reached is logged, not fatal: it only costs the hang reports their peer state.
  void publish_created();

  double timeout_for(const OpDesc& d) const;
  void debug_check(const Ticket& t);
  std::string dump_flight(const std::string& reason);
  // What the out-of-band store says about the other members at `t` (which never arrived, which are
  // ahead). Every store step has its own deadline; an unreachable store is reported, not waited on.
  std::string peer_report(const Ticket& t);

  std::shared_ptr<WorldContext> ctx_;
  std::string name_;
  std::string uid_;
  int rank_;
  std::vector<int> world_ranks_;
  CommOptions options_;
  CommStats stats_;
  FlightRecorder recorder_;
  uint64_t seq_ = 0;
  uint64_t p2p_seq_ = 0;
  int splits_ = 0;
  std::atomic<bool> aborted_{false};
  mutable std::mutex failure_mu_;
  std::string failure_;
  bool failure_timed_out_ = false;
  // The failure has reached a caller: fail_timeout()/fail_error() tell it by throwing, except on a
  // backend's own thread; until then check_usable() throws the failure itself rather than
  // "aborted by an earlier failure".
  mutable bool failure_told_ = false;
};

// A Work that is already complete (size-1 groups, empty tensors).
class DoneWork : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

// Throws CommError naming the op, group and rank unless `t` is defined, contiguous (when
// `contiguous`) and on `device` (CommBase::check_op_tensor's default).
void check_tensor(const CommBase& c, const char* op, const at::Tensor& t, c10::DeviceType device,
                  bool contiguous = true);

}  // namespace parallax::comm::detail
