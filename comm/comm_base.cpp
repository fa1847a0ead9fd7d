// CommBase (comm_base.h): the op lifecycle every backend shares (numbering, the flight recorder,
// the hang-report board, the debug check), the failure paths (timeout and backend error: report,
// dump, abort, throw once), split() on a backend's byte all-gather, and the opening of each op's
// ticket. The argument checks live in op_checks.cpp, the debug check in debug_check.cpp, the hang
// report in peer_report.cpp.
#include "comm/comm_base.h"

#include "core/error.h"
#include "core/log.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>

namespace parallax::comm::detail {

CommBase::CommBase(std::shared_ptr<WorldContext> ctx, std::string name, std::string uid, int rank,
                   std::vector<int> world_ranks, CommOptions options)
    : ctx_(std::move(ctx)),
      name_(std::move(name)),
      uid_(std::move(uid)),
      rank_(rank),
      world_ranks_(std::move(world_ranks)),
      options_(options),
      recorder_(options.flight_recorder_size) {
  ctx_->register_comm(this);
}

CommBase::~CommBase() {
  ctx_->unregister_comm(this);
}

double CommBase::timeout_for(const OpDesc& d) const {
  if (d.kind == OpKind::kSplit) return options_.init_timeout_s;
  if (d.kind == OpKind::kBarrier && d.barrier == BarrierKind::kCheckpoint)
    return options_.checkpoint_timeout_s;
  return options_.timeout_s;
}

void CommBase::check_usable(const char* what) const {
  if (!aborted_) return;
  {
    // The first caller to meet the failure gets it as it was: the watchdog that timed the op out
    // reported it to no one, and "aborted by an earlier failure" would bury the cause.
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (!failure_told_ && !failure_.empty()) {
      failure_told_ = true;
      if (failure_timed_out_) throw TimeoutError(failure_);
      throw CommError(failure_);
    }
  }
  throw_error<CommError>(
      "{} on group '{}' (world rank {}): the communicator was aborted by an earlier failure and "
      "cannot be used again (create a new one). Earlier failure: {}",
      what, name_, ctx_->rank, failure_message());
}

namespace {
// Set on a backend's own thread (the NCCL watchdog), whose throws reach no caller.
thread_local bool comm_backend_thread = false;
}  // namespace

void CommBase::this_thread_is_backends() {
  comm_backend_thread = true;
}

std::string CommBase::failure_message() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return failure_;
}

Ticket CommBase::begin(OpDesc desc) {
  check_usable(op_name(desc.kind));
  PARALLAX_CHECK(!ctx_->shut_down, CommError, "{} on group '{}': the World has been shut down",
                 op_name(desc.kind), name_);
  Ticket t;
  t.timeout_s = timeout_for(desc);
  t.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(t.timeout_s));
  FlightEntry e;
  const bool p2p = is_p2p(desc.kind);
  if (p2p) {
    t.p2p_seq = ++p2p_seq_;
    stats_.p2p_ops += 1;
    e.peers = {world_ranks_.at(static_cast<size_t>(desc.root))};
  } else {
    t.seq = ++seq_;
    stats_.collectives += 1;
    e.peers = world_ranks_;
  }
  e.seq = t.seq;
  e.p2p_seq = t.p2p_seq;
  e.op = op_name(desc.kind);
  e.group = name_;
  e.detail = op_detail(desc);
  e.dtype = dtype_name(desc.dtype);
  e.shape = desc.shape;
  e.bytes = desc.bytes();
  e.site = format_site(desc.site);
  e.issued_at = wall_seconds();
  t.desc = std::move(desc);
  t.record_id = recorder_.record(std::move(e));
  if (!p2p && ctx_->board) {
    ctx_->board->publish(uid_, t.seq,
                         [d = t.desc] { return d.summary() + " at " + format_site(d.site); });
  }
  if (!p2p && options_.debug_collectives && size() > 1) debug_check(t);
  return t;
}

void CommBase::complete(const Ticket& t) {
  recorder_.set_state(t.record_id, OpState::kCompleted);
}

void CommBase::captured(const Ticket& t) {
  recorder_.set_state(t.record_id, OpState::kCaptured);
}
std::string CommBase::dump_flight(const std::string& reason) {
  std::string json = ctx_->flight_json(reason);
  std::string path = write_flight_dump(ctx_->rank, json, ctx_->report_dir());
  // The console gets the one error line (with the path); the failing communicator's recent ops go
  // to the console only when the dump could not be written, so that they are not lost.
  auto entries = recorder_.snapshot();
  const size_t first = entries.size() > 16 ? entries.size() - 16 : 0;
  const core::log::Level level = path.empty() ? core::log::Level::kError : core::log::Level::kDebug;
  if (core::log::enabled(level)) {
    core::log::write(
        level, fmt::format("flight recorder of group '{}' on world rank {} (last {} of {} ops{}):",
                           name_, ctx_->rank, entries.size() - first, recorder_.total_recorded(),
                           path.empty() ? "" : ", all groups in " + path));
    for (size_t i = first; i < entries.size(); ++i)
      core::log::write(level, "  " + to_json(entries[i]));
  }
  return path;
}

[[noreturn]] void CommBase::fail_timeout(const Ticket& t, const std::string& where) {
  recorder_.set_state(t.record_id, OpState::kTimedOut);
  aborted_ = true;
  ctx_->failed = true;
  const std::string arrival = peer_report(t);
  std::string head = fmt::format(
      "{} on group '{}' (world ranks [{}]) timed out after {:.1f} s on world rank {}{}: {}, called "
      "at {}. {}.",
      op_label(t, world_ranks_), name_, fmt::join(world_ranks_, ", "), t.timeout_s, ctx_->rank,
      where, t.desc.tensor_text(), format_site(t.desc.site), arrival);
  std::string path = dump_flight(head);
  std::string msg = path.empty() ? head : fmt::format("{} Flight recorder: {}", head, path);
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    failure_ = msg;
    failure_timed_out_ = true;
    failure_told_ = !comm_backend_thread;  // the throw below tells a caller
  }
  core::log::debug("{}", msg);  // the exception carries it to the one error line
  abort_backend();
  throw TimeoutError(msg);
}

[[noreturn]] void CommBase::fail_error(const Ticket& t, const std::string& what) {
  recorder_.set_state(t.record_id, OpState::kFailed);
  aborted_ = true;
  ctx_->failed = true;
  std::string head = fmt::format(
      "{} on group '{}' (world ranks [{}]) failed on world rank {}: {}, called at {}: {}. {}",
      op_label(t, world_ranks_), name_, fmt::join(world_ranks_, ", "), ctx_->rank,
      t.desc.tensor_text(), format_site(t.desc.site), first_line(what), peer_report(t));
  std::string path = dump_flight(head);
  std::string msg = path.empty() ? head : fmt::format("{}. Flight recorder: {}", head, path);
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    failure_ = msg;
    failure_told_ = !comm_backend_thread;  // the throw below tells a caller
  }
  core::log::debug("{}", msg);  // the exception carries it to the one error line
  abort_backend();
  throw CommError(msg);
}

std::shared_ptr<Communicator> CommBase::split(int color, int key, const std::string& name,
                                              CallSite site) {
  OpDesc d;
  d.kind = OpKind::kSplit;
  d.site = site;
  Ticket t = begin(d);
  std::vector<uint8_t> mine(2 * sizeof(int64_t));
  const int64_t ck[2] = {color, key};
  std::memcpy(mine.data(), ck, sizeof(ck));
  auto all = allgather_bytes(mine, t);
  std::vector<std::pair<int64_t, int>> members_by_key;
  for (int r = 0; r < size(); ++r) {
    int64_t v[2];
    std::memcpy(v, all[static_cast<size_t>(r)].data(), sizeof(v));
    if (color >= 0 && v[0] == color) members_by_key.emplace_back(v[1], r);
  }
  std::sort(members_by_key.begin(), members_by_key.end());
  std::vector<int> members;
  for (auto& [k, r] : members_by_key) members.push_back(r);
  ++splits_;
  const std::string child_uid =
      fmt::format("{}/{}{}.{}", uid_, name, splits_, color < 0 ? -1 : color);
  std::shared_ptr<CommBase> child = create_child(color, members, name, child_uid, t);
  complete(t);
  return child;
}

// ---- opening ops -----------------------------------------------------------------------------

Ticket CommBase::open_reduction(OpKind kind, const at::Tensor& tensor, ReduceOp op, CallSite site,
                                AllReduceAlgo algo, c10::ScalarType wire) {
  OpDesc d = tensor_desc(kind, tensor, site);
  if (wire != c10::ScalarType::Undefined) d.dtype = wire;  // what the debug check compares
  d.reduce = op;
  d.algo = algo;
  return begin(std::move(d));
}

Ticket CommBase::open_all_gather(OpKind kind, const at::Tensor& input, int64_t total,
                                 CallSite site) {
  OpDesc d = tensor_desc(kind, input, site);
  d.match_numel = total;
  return begin(std::move(d));
}

Ticket CommBase::open_rooted(OpKind kind, const at::Tensor& tensor, int root, CallSite site,
                             int tag) {
  OpDesc d = tensor_desc(kind, tensor, site);
  d.root = root;
  d.tag = tag;
  Ticket t = begin(std::move(d));
  if (kind == OpKind::kSend)
    stats_.bytes_sent += tensor.numel() * static_cast<int64_t>(tensor.element_size());
  return t;
}

Ticket CommBase::open_barrier(BarrierKind kind, CallSite site) {
  OpDesc d;
  d.kind = OpKind::kBarrier;
  d.barrier = kind;
  d.site = site;
  return begin(std::move(d));
}

WorkPtr CommBase::complete_now(const Ticket& t) {
  complete(t);
  return std::make_shared<DoneWork>();
}

void CommBase::publish_created() {
  if (!ctx_->board) return;
  try {
    ctx_->board->publish_now(uid_, 0, "created");
  } catch (const std::exception& e) {
    core::log::warn("group '{}': could not publish to the hang-report store: {}", name_, e.what());
  }
}

}  // namespace parallax::comm::detail
