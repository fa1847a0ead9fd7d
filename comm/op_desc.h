// Internal: what one communicator op is, as every backend, the flight recorder and the failure
// messages see it. OpDesc describes the call (kind, reduce op, dtype, shape, peer or root, call
// site); a Ticket is an opened op (its sequence number, deadline and flight-recorder entry). The
// text helpers are the one way an op is named in logs, hang reports and errors. Not part of the
// public API.
#pragma once

#include "comm/communicator.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace parallax::comm::detail {

using Clock = std::chrono::steady_clock;

enum class OpKind : int32_t {
  kAllReduce = 1,
  kReduceScatter,
  kAllGather,
  kAllGatherList,
  kBroadcast,
  kBarrier,
  kSplit,
  kSend,
  kRecv,
};
const char* op_name(OpKind kind);
bool is_p2p(OpKind kind);

struct OpDesc {
  OpKind kind = OpKind::kBarrier;
  ReduceOp reduce = ReduceOp::kSum;
  AllReduceAlgo algo = AllReduceAlgo::kNative;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<int64_t> shape;  // this rank's tensor (input for reduce_scatter / all_gather)
  int64_t numel = 0;
  int64_t match_numel = 0;  // must agree across members (debug check)
  int root = -1;            // broadcast root or p2p peer (group rank)
  int tag = 0;
  BarrierKind barrier = BarrierKind::kDefault;
  int tensors = 1;  // all_reduce_coalesced: how many tensors `shape` (their total) spans
  CallSite site;

  // "all_reduce(sum, native) float32[8, 4]"
  std::string summary() const;
  std::string tensor_text() const;  // "float32[8, 4] (128 B)"
  int64_t bytes() const;
};

OpDesc tensor_desc(OpKind kind, const at::Tensor& t, CallSite site);

struct Ticket {
  uint64_t seq = 0;      // collectives
  uint64_t p2p_seq = 0;  // send/recv
  uint64_t record_id = 0;
  Clock::time_point deadline;
  double timeout_s = 0;
  OpDesc desc;
};

// "float32", "bfloat16", ...; "" for Undefined.
std::string dtype_name(c10::ScalarType t);
// What the op's kind leaves unsaid: "sum, ring", "root 1", "to 2, tag 7"; "" when nothing.
std::string op_detail(const OpDesc& d);
// How an opened op is named in failure messages: "all_reduce(sum, native) #12", or for p2p
// "send to rank 1 (world 3), tag 0, p2p #4". `world_ranks` maps the group's ranks to the world's.
std::string op_label(const Ticket& t, const std::vector<int>& world_ranks);
// The first line of an error text (c10's messages carry a stack trace after it), at most 300
// characters.
std::string first_line(const std::string& text);

}  // namespace parallax::comm::detail
