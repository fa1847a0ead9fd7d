#include "parallel/comm/comm_base.h"

#include "core/error.h"
#include "core/log.h"
#include "core/strings.h"

#include <c10/util/Exception.h>
#include <fmt/ranges.h>
#include <algorithm>
#include <cstring>
#include <thread>

namespace parallax::parallel::comm::detail {

const char* op_name(OpKind kind) {
  switch (kind) {
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kAllGatherList:
      return "all_gather(list)";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kSplit:
      return "split";
    case OpKind::kSend:
      return "send";
    case OpKind::kRecv:
      return "recv";
  }
  return "?";
}

bool is_p2p(OpKind kind) {
  return kind == OpKind::kSend || kind == OpKind::kRecv;
}

namespace {

// How long a hang report waits for the store (the peers' sequence numbers) before it reports what
// this rank knows: the store may live in a stopped or dead rank, whose calls never return.
constexpr std::chrono::milliseconds kReportStoreDeadline{10000};
// How long a peer's heartbeat must stall to be reported as not responding (6 heartbeats).
constexpr std::chrono::milliseconds kSilenceWindow{1500};

// The first line of an error text (c10's messages carry a stack trace after it).
std::string first_line(const std::string& text) {
  const std::string line = text.substr(0, text.find('\n'));
  return line.size() > 300 ? line.substr(0, 300) + "..." : line;
}

std::string dtype_name(c10::ScalarType t) {
  if (t == c10::ScalarType::Undefined) return "";
  switch (t) {
    case c10::ScalarType::Float:
      return "float32";
    case c10::ScalarType::Double:
      return "float64";
    case c10::ScalarType::Half:
      return "float16";
    case c10::ScalarType::BFloat16:
      return "bfloat16";
    case c10::ScalarType::Long:
      return "int64";
    case c10::ScalarType::Int:
      return "int32";
    case c10::ScalarType::Byte:
      return "uint8";
    case c10::ScalarType::Char:
      return "int8";
    case c10::ScalarType::Bool:
      return "bool";
    default:
      return c10::toString(t);
  }
}

std::string detail_of(const OpDesc& d) {
  switch (d.kind) {
    case OpKind::kAllReduce:
      if (d.tensors > 1)
        return fmt::format("{}, {}, {} tensors", to_string(d.reduce), to_string(d.algo), d.tensors);
      return fmt::format("{}, {}", to_string(d.reduce), to_string(d.algo));
    case OpKind::kReduceScatter:
      return to_string(d.reduce);
    case OpKind::kBroadcast:
      return fmt::format("root {}", d.root);
    case OpKind::kBarrier:
      return d.barrier == BarrierKind::kCheckpoint ? "checkpoint" : "default";
    case OpKind::kSend:
      return fmt::format("to {}, tag {}", d.root, d.tag);
    case OpKind::kRecv:
      return fmt::format("from {}, tag {}", d.root, d.tag);
    default:
      return "";
  }
}

std::string copy_str(const char* s, size_t n) {
  return std::string(s, strnlen(s, n));
}

}  // namespace

int64_t OpDesc::bytes() const {
  if (dtype == c10::ScalarType::Undefined) return 0;
  return numel * static_cast<int64_t>(c10::elementSize(dtype));
}

std::string OpDesc::tensor_text() const {
  if (dtype == c10::ScalarType::Undefined) return "no tensor";
  return fmt::format("{}[{}] ({})", dtype_name(dtype), fmt::join(shape, ", "),
                     core::human_bytes(double(bytes())));
}

std::string OpDesc::summary() const {
  std::string d = detail_of(*this);
  std::string s = d.empty() ? std::string(op_name(kind)) : fmt::format("{}({})", op_name(kind), d);
  if (dtype != c10::ScalarType::Undefined)
    s += fmt::format(" {}[{}]", dtype_name(dtype), fmt::join(shape, ", "));
  return s;
}

OpDesc tensor_desc(OpKind kind, const at::Tensor& t, CallSite site) {
  OpDesc d;
  d.kind = kind;
  d.site = site;
  if (t.defined()) {
    d.dtype = t.scalar_type();
    d.shape = t.sizes().vec();
    d.numel = t.numel();
    d.match_numel = d.numel;
  }
  return d;
}

// ---- CommBase --------------------------------------------------------------------------------

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
  e.detail = detail_of(desc);
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

namespace {

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

namespace {

std::string op_label(const Ticket& t, const std::vector<int>& world_ranks) {
  const OpDesc& d = t.desc;
  if (d.kind == OpKind::kSend || d.kind == OpKind::kRecv) {
    return fmt::format("{} {} rank {} (world {}), tag {}, p2p #{}", op_name(d.kind),
                       d.kind == OpKind::kSend ? "to" : "from", d.root,
                       world_ranks.at(static_cast<size_t>(d.root)), d.tag, t.p2p_seq);
  }
  std::string det = detail_of(d);
  return det.empty() ? fmt::format("{} #{}", op_name(d.kind), t.seq)
                     : fmt::format("{}({}) #{}", op_name(d.kind), det, t.seq);
}

}  // namespace

// Which members never arrived: each rank publishes its last issued sequence number per group to
// the store, independently of the stuck op.
std::string CommBase::peer_report(const Ticket& t) {
  std::string arrival;
  if (!ctx_->board) {
    arrival = "Peer state unknown (no out-of-band store)";
  } else {
    try {
      // Each step has its own deadline: the store may live in the rank that stopped.
      ctx_->board->flush(std::chrono::milliseconds(1000));
      std::this_thread::sleep_for(SeqBoard::kFlushInterval *
                                  5);  // let the peers' last updates land
      // At most the op's own timeout: a short parallel.timeout_s (a start-up deadline) is not
      // doubled by the report when the store's host is the rank that stopped.
      const auto store_deadline =
          std::min(kReportStoreDeadline, std::chrono::milliseconds(static_cast<int64_t>(
                                             std::max(0.1, options_.timeout_s) * 1000)));
      auto states = ctx_->board->read(uid_, world_ranks_, store_deadline);
      // Which peers stopped responding at all (their board writer's heartbeat stalled).
      const auto silent = ctx_->board->unresponsive(world_ranks_, kSilenceWindow, store_deadline);
      const int me = ctx_->rank;
      if (is_p2p(t.desc.kind)) {
        const int peer = world_ranks_.at(static_cast<size_t>(t.desc.root));
        const auto& s = states[peer];
        // Alive only when its heartbeat goes on (a dead peer's last published state stays in the
        // store).
        const bool responding = std::find(silent.begin(), silent.end(), peer) == silent.end();
        arrival =
            s.known
                ? fmt::format("Peer world rank {}{}: its last collective on this group was #{} {}",
                              peer, responding ? " is alive" : "", s.seq, s.summary)
                : fmt::format("Peer world rank {} never published a state for this group", peer);
      } else {
        std::vector<std::string> missing, ahead;
        std::vector<int> missing_ranks;
        for (int r : world_ranks_) {
          if (r == me) continue;
          const auto& s = states[r];
          if (!s.known) {
            missing.push_back(fmt::format("world rank {} (no state published)", r));
            missing_ranks.push_back(r);
          } else if (s.seq < t.seq) {
            missing.push_back(
                s.seq == 0
                    ? fmt::format("world rank {} (issued nothing on this group)", r)
                    : fmt::format("world rank {} (last issued #{} {})", r, s.seq, s.summary));
            missing_ranks.push_back(r);
          } else if (s.seq > t.seq) {
            ahead.push_back(fmt::format("world rank {} is already at #{} {}", r, s.seq, s.summary));
          }
        }
        if (!missing.empty()) {
          arrival = fmt::format("Ranks that never arrived: [{}]: {}",
                                fmt::join(missing_ranks, ", "), fmt::join(missing, "; "));
        } else {
          arrival = fmt::format(
              "Every member issued #{}: the op failed or is stuck inside the {} backend (a peer "
              "died "
              "or the network failed)",
              t.seq, backend());
        }
        if (!ahead.empty()) arrival += fmt::format(" ({})", fmt::join(ahead, "; "));
      }
      if (!silent.empty()) {
        arrival += fmt::format(
            ". Not responding (no heartbeat for {:.1f} s: stopped, killed or wedged): world rank{} "
            "{}",
            kSilenceWindow.count() / 1000.0, silent.size() > 1 ? "s" : "", fmt::join(silent, ", "));
      }
    } catch (const c10::Error& e) {
      arrival = fmt::format("Peer state unknown (store unreachable: {})",
                            first_line(e.what_without_backtrace()));
    } catch (const std::exception& e) {
      arrival = fmt::format("Peer state unknown (store unreachable: {})", first_line(e.what()));
    }
  }
  return arrival;
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

// ---- PollWork --------------------------------------------------------------------------------

PollWork::PollWork(std::shared_ptr<CommBase> comm, Ticket ticket, PollFn poll,
                   std::function<void()> on_done, std::shared_ptr<void> keep_alive)
    : comm_(std::move(comm)),
      ticket_(std::move(ticket)),
      poll_(std::move(poll)),
      on_done_(std::move(on_done)),
      keep_alive_(std::move(keep_alive)) {}

PollWork::~PollWork() {
  // A pending op dropped without wait(): its buffers may still be in use by the backend.
  if (!done_ && keep_alive_) comm_->ctx()->bury(std::move(keep_alive_));
}

bool PollWork::step() {
  if (done_) return true;
  if (error_) std::rethrow_exception(error_);
  try {
    comm_->ctx()->progress_all();
    if (comm_->aborted()) {
      comm_->check_usable(op_name(ticket_.desc.kind));
    }
    bool finished = false;
    try {
      finished = poll_();
    } catch (const std::exception& e) {
      comm_->ctx()->bury(std::move(keep_alive_));
      comm_->fail_error(ticket_, e.what());
    }
    if (finished) {
      if (on_done_) on_done_();
      comm_->complete(ticket_);
      done_ = true;
      keep_alive_.reset();
      return true;
    }
    if (Clock::now() > ticket_.deadline) {
      comm_->ctx()->bury(std::move(keep_alive_));
      comm_->fail_timeout(ticket_);
    }
    return false;
  } catch (...) {
    error_ = std::current_exception();
    if (keep_alive_) comm_->ctx()->bury(std::move(keep_alive_));
    throw;
  }
}

void PollWork::wait() {
  // MPI and the CPU ring advance only while polled, so the loop keeps polling (yielding the core
  // between polls); only a wait that has already lasted seconds (a straggler) backs off to sleeps.
  int spins = 0;
  const auto start = Clock::now();
  while (!step()) {
    if (++spins < 64) continue;
    if (Clock::now() - start < std::chrono::seconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

bool PollWork::is_completed() {
  return step();
}

// ---- validation ------------------------------------------------------------------------------

void check_tensor(const CommBase& c, const char* op, const at::Tensor& t, c10::DeviceType device,
                  bool contiguous) {
  PARALLAX_CHECK(t.defined(), CommError, "{} on group '{}' (rank {}): undefined tensor", op,
                 c.name(), c.rank());
  PARALLAX_CHECK(!contiguous || t.is_contiguous(), CommError,
                 "{} on group '{}' (rank {}): tensor of shape [{}] is not contiguous", op, c.name(),
                 c.rank(), fmt::join(t.sizes(), ", "));
  PARALLAX_CHECK(t.device().type() == device, CommError,
                 "{} on group '{}' (rank {}): the {} backend needs {} tensors, got a tensor on {}",
                 op, c.name(), c.rank(), c.backend(), c10::DeviceTypeName(device, true),
                 t.device().str());
}

namespace {

// `chunk` has `whole`'s dtype and this rank's share of its elements (chunk_numel).
void check_chunk_shapes(const CommBase& c, const char* op, const at::Tensor& whole,
                        const char* whole_name, const at::Tensor& chunk, const char* chunk_name) {
  const int n = c.size();
  const int64_t m = whole.numel(), want = chunk_numel(m, n, c.rank());
  PARALLAX_CHECK(chunk.scalar_type() == whole.scalar_type(), CommError,
                 "{} on group '{}' (rank {}): {} is {} but {} is {}", op, c.name(), c.rank(),
                 whole_name, c10::toString(whole.scalar_type()), chunk_name,
                 c10::toString(chunk.scalar_type()));
  PARALLAX_CHECK(chunk.numel() == want, CommError,
                 "{} on group '{}' (rank {}): {} has {} elements but chunk {} of the {}-element {} "
                 "over {} ranks "
                 "has {}",
                 op, c.name(), c.rank(), chunk_name, chunk.numel(), c.rank(), m, whole_name, n,
                 want);
}

}  // namespace

void CommBase::check_op_tensor(const char* op, const at::Tensor& t, bool contiguous) const {
  check_tensor(*this, op, t, device_type(), contiguous);
}

void CommBase::check_all_reduce_args(const char* op, const at::Tensor& tensor,
                                     bool contiguous) const {
  check_op_tensor(op, tensor, contiguous);
  check_op_dtype(op, tensor, true);
}

void CommBase::check_reduce_scatter_args(const at::Tensor& input, const at::Tensor& output) const {
  check_op_tensor("reduce_scatter", input, true);
  check_op_tensor("reduce_scatter", output, true);
  check_op_dtype("reduce_scatter", input, true);
  check_chunk_shapes(*this, "reduce_scatter", input, "input", output, "output");
}

int64_t CommBase::check_all_gather_args(const at::Tensor& input, const at::Tensor& output) const {
  check_op_tensor("all_gather", input, true);
  check_op_tensor("all_gather", output, true);
  check_op_dtype("all_gather", input, false);
  check_chunk_shapes(*this, "all_gather", output, "output", input, "input");
  return output.numel();
}

int64_t CommBase::check_all_gather_args(const at::Tensor& input,
                                        const std::vector<at::Tensor>& outputs) const {
  check_op_tensor("all_gather", input, true);
  check_op_dtype("all_gather", input, false);
  const int n = size();
  PARALLAX_CHECK(static_cast<int>(outputs.size()) == n, CommError,
                 "all_gather on group '{}' (rank {}): {} output tensors for {} ranks", name_, rank_,
                 outputs.size(), n);
  int64_t total = 0;
  for (int r = 0; r < n; ++r) {
    const auto& o = outputs[static_cast<size_t>(r)];
    PARALLAX_CHECK(o.defined() && o.scalar_type() == input.scalar_type(), CommError,
                   "all_gather on group '{}' (rank {}): output {} is {} but the input is {}", name_,
                   rank_, r, o.defined() ? c10::toString(o.scalar_type()) : "undefined",
                   c10::toString(input.scalar_type()));
    total += o.numel();
  }
  const auto& mine = outputs[static_cast<size_t>(rank_)];
  PARALLAX_CHECK(
      mine.numel() == input.numel(), CommError,
      "all_gather on group '{}' (rank {}): output {} has {} elements but the input has {}", name_,
      rank_, rank_, mine.numel(), input.numel());
  for (const auto& o : outputs) check_op_tensor("all_gather", o, true);
  return total;
}

void CommBase::check_broadcast_args(const at::Tensor& tensor, int root) const {
  check_op_tensor("broadcast", tensor, true);
  check_op_dtype("broadcast", tensor, false);
  PARALLAX_CHECK(root >= 0 && root < size(), CommError,
                 "broadcast on group '{}' (rank {}): root {} is not a rank of {}", name_, rank_,
                 root, size());
}

void CommBase::check_p2p_args(const char* op, const at::Tensor& tensor, int peer, int tag) const {
  check_op_tensor(op, tensor, true);
  check_op_dtype(op, tensor, false);
  PARALLAX_CHECK(peer >= 0 && peer < size() && peer != rank_, CommError,
                 "{} on group '{}' (rank {}): peer {} is not another rank of this group of {}", op,
                 name_, rank_, peer, size());
  PARALLAX_CHECK(tag >= 0 && tag < kMaxUserTag, CommError,
                 "{} on group '{}' (rank {}): tag {} is outside [0, {}) (larger tags are reserved)",
                 op, name_, rank_, tag, kMaxUserTag);
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

}  // namespace parallax::parallel::comm::detail
