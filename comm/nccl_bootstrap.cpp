#ifdef PARALLAX_WITH_NCCL

// The nccl backend: the world communicator, splits, construction (nccl_internal.h has the class).
#include "comm/nccl_internal.h"

#include <cstdlib>
#include <cstring>

namespace parallax::comm::detail::nccl {

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

Clock::time_point after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

namespace {

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

}  // namespace

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
ncclComm_t make_blocking_twin(ncclComm_t ctrl, int rank, Clock::time_point deadline,
                              const std::string& what) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t twin = nullptr;
  ncclResult_t rc = ncclCommSplit(ctrl, 0, rank, &twin, &config);
  try {
    if (rc != ncclSuccess && rc != ncclInProgress)
      throw CommError(fmt::format("ncclCommSplit ({} data path): {}", what, nccl_error(rc, ctrl)));
    wait_ready(ctrl, deadline, "ncclCommSplit (" + what + " data path)");
    if (twin)
      wait_ready(twin, deadline, "ncclCommSplit (" + what + " data path, new communicator)");
  } catch (...) {
    if (twin) ncclCommAbort(twin);
    throw;
  }
  PARALLAX_CHECK(twin != nullptr, CommError,
                 "ncclCommSplit ({} data path) returned no communicator", what);
  return twin;
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<WorldContext> ctx, ncclComm_t comm,
                                   ncclComm_t ctrl, c10::Device device, std::string name,
                                   std::string uid, int rank, std::vector<int> world_ranks,
                                   CommOptions options)
    : CommBase(std::move(ctx), std::move(name), std::move(uid), rank, std::move(world_ranks),
               options),
      comm_(comm),
      ctrl_(ctrl),
      device_(device),
      stream_(c10::cuda::getStreamFromPool(true, device.index())),
      reduce_stream_(c10::cuda::getStreamFromPool(true, device.index())) {
  publish_created();
  watchdog_ = std::thread([this] { watchdog(); });
}

NcclCommunicator::~NcclCommunicator() {
  ctx_->unregister_comm(this);
  release_backend();
}

std::shared_ptr<CommBase> NcclCommunicator::create_child(int color, const std::vector<int>& members,
                                                         const std::string& name,
                                                         const std::string& uid, const Ticket& t) {
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

}  // namespace parallax::comm::detail::nccl

namespace parallax::comm::detail {

using nccl::after;
using nccl::connect_at_creation;
using nccl::make_blocking_twin;
using nccl::nccl_error;
using nccl::NcclCommunicator;
using nccl::nonblocking_config;
using nccl::wait_ready;

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

}  // namespace parallax::comm::detail

#endif  // PARALLAX_WITH_NCCL
