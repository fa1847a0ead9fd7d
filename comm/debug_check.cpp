// The debug cross-check of collectives (CommOptions::debug_collectives): before each collective
// every member all-gathers a fixed-size descriptor of its call, and a difference (op, group,
// sequence number, reduce op, algorithm, root, dtype, size) fails the op on every rank with both
// calls named, instead of a hang or silently wrong numbers.
#include "comm/comm_base.h"

#include "core/error.h"
#include "core/log.h"

#include <algorithm>
#include <cstring>

namespace parallax::comm::detail {
namespace {

// Fixed-size descriptor exchanged by the debug check (and nothing else).
struct WireDesc {
  uint64_t seq;
  int32_t kind, reduce, algo, dtype, root, barrier, ndim, pad;
  int64_t match_numel;
  int64_t shape[8];
  char site[320];
  char group[64];
};
static_assert(sizeof(WireDesc) == 496, "WireDesc layout");

std::string copy_str(const char* s, size_t n) {
  return std::string(s, strnlen(s, n));
}

WireDesc encode(const OpDesc& d, uint64_t seq, const std::string& group) {
  WireDesc w;
  std::memset(&w, 0, sizeof(w));
  w.seq = seq;
  w.kind = static_cast<int32_t>(d.kind);
  w.reduce = static_cast<int32_t>(d.reduce);
  w.algo = static_cast<int32_t>(d.algo);
  w.dtype = static_cast<int32_t>(d.dtype);
  w.root = d.root;
  w.barrier = static_cast<int32_t>(d.barrier);
  w.ndim = static_cast<int32_t>(std::min<size_t>(d.shape.size(), 8));
  w.match_numel = d.match_numel;
  for (int i = 0; i < w.ndim; ++i) w.shape[i] = d.shape[static_cast<size_t>(i)];
  std::string site = format_site(d.site);
  std::strncpy(w.site, site.c_str(), sizeof(w.site) - 1);
  std::strncpy(w.group, group.c_str(), sizeof(w.group) - 1);
  return w;
}

std::string describe_wire(const WireDesc& w) {
  OpDesc d;
  d.kind = static_cast<OpKind>(w.kind);
  d.reduce = static_cast<ReduceOp>(w.reduce);
  d.algo = static_cast<AllReduceAlgo>(w.algo);
  d.dtype = static_cast<c10::ScalarType>(w.dtype);
  d.root = w.root;
  d.barrier = static_cast<BarrierKind>(w.barrier);
  d.shape.assign(w.shape, w.shape + std::clamp(w.ndim, 0, 8));
  return fmt::format("{} #{} at {}", d.summary(), w.seq, copy_str(w.site, sizeof(w.site)));
}

// Returns "" when `a` and `b` describe the same collective, else what differs.
std::string wire_difference(const WireDesc& a, const WireDesc& b) {
  if (a.kind != b.kind) return "op";
  const auto kind = static_cast<OpKind>(a.kind);
  if (copy_str(a.group, sizeof(a.group)) != copy_str(b.group, sizeof(b.group))) return "group";
  if (a.seq != b.seq) return "sequence number";
  if ((kind == OpKind::kAllReduce || kind == OpKind::kReduceScatter) && a.reduce != b.reduce)
    return "reduce op";
  if (kind == OpKind::kAllReduce && a.algo != b.algo) return "algorithm";
  if (kind == OpKind::kBarrier && a.barrier != b.barrier) return "barrier kind";
  if (kind == OpKind::kBroadcast && a.root != b.root) return "root";
  if (a.dtype != b.dtype) return "dtype";
  if (a.match_numel != b.match_numel) return "size";
  return "";
}

}  // namespace

void CommBase::debug_check(const Ticket& t) {
  const WireDesc mine = encode(t.desc, t.seq, name_);
  std::vector<uint8_t> bytes(sizeof(WireDesc));
  std::memcpy(bytes.data(), &mine, sizeof(WireDesc));
  auto all = allgather_bytes(bytes, t);
  std::vector<WireDesc> descs(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    PARALLAX_CHECK(all[r].size() == sizeof(WireDesc), CommError,
                   "debug check on group '{}': bad descriptor from rank {}", name_, r);
    std::memcpy(&descs[r], all[r].data(), sizeof(WireDesc));
  }
  // Compare everyone with group rank 0 so that every member reports the same pair.
  for (size_t r = 1; r < descs.size(); ++r) {
    std::string diff = wire_difference(descs[0], descs[r]);
    if (diff.empty()) continue;
    std::string msg = fmt::format(
        "collective mismatch on group '{}' (debug_collectives, detected on world rank {}): the {} "
        "differs: "
        "rank {} (world {}) called {}, but rank {} (world {}) called {}",
        name_, ctx_->rank, diff, 0, world_ranks_[0], describe_wire(descs[0]), r, world_ranks_[r],
        describe_wire(descs[r]));
    recorder_.set_state(t.record_id, OpState::kFailed);
    {
      std::lock_guard<std::mutex> lock(failure_mu_);
      failure_ = msg;
    }
    aborted_ = true;
    core::log::error("{}", msg);
    throw CommError(msg);
  }
}

}  // namespace parallax::comm::detail
