#include "comm/mpi_communicator.h"
#include "comm/poll_work.h"
#include "comm/startup.h"

#include "core/error.h"

#include <ATen/ATen.h>

#include <climits>
#include <cstring>
#include <thread>

namespace parallax::comm::detail {

namespace {

bool is_16bit_float(c10::ScalarType t) {
  return t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16;
}

// The MPI type that moves (and, for non-16-bit types, reduces) elements of `t`.
MPI_Datatype mpi_type(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
      return MPI_FLOAT;
    case c10::ScalarType::Double:
      return MPI_DOUBLE;
    case c10::ScalarType::Long:
      return MPI_INT64_T;
    case c10::ScalarType::Int:
      return MPI_INT32_T;
    case c10::ScalarType::Byte:
      return MPI_UINT8_T;
    case c10::ScalarType::Char:
      return MPI_INT8_T;
    case c10::ScalarType::Bool:
      return MPI_UINT8_T;
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16:
      return MPI_UINT16_T;
    default:
      return MPI_DATATYPE_NULL;
  }
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return MPI_SUM;
    case ReduceOp::kMax:
      return MPI_MAX;
    case ReduceOp::kMin:
      return MPI_MIN;
  }
  return MPI_SUM;
}

int count_of(const CommBase& c, const char* op, int64_t numel) {
  PARALLAX_CHECK(numel <= INT_MAX, CommError,
                 "{} on group '{}' (rank {}): {} elements exceed MPI's int count; split the tensor",
                 op, c.name(), c.rank(), numel);
  return static_cast<int>(numel);
}

void divide_avg(at::Tensor& t, int n) {
  if (at::isIntegralType(t.scalar_type(), false)) {
    t.div_(n, "trunc");
  } else {
    t.div_(n);
  }
}

class MpiRequest final : public RingTransport::Request {
 public:
  explicit MpiRequest(MPI_Request r) : req_(r) {}
  bool test() override {
    if (req_ == MPI_REQUEST_NULL) return true;
    int done = 0;
    MPI_Status status;
    int rc = MPI_Test(&req_, &done, &status);
    if (rc != MPI_SUCCESS) {
      char buf[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(rc, buf, &len);
      throw CommError(fmt::format("MPI_Test failed: {}", std::string(buf, len)));
    }
    return done != 0;
  }

 private:
  MPI_Request req_;
};

// Keeps the tensors of a pending op alive (for bury()).
struct Keep {
  std::vector<at::Tensor> tensors;
  std::shared_ptr<void> extra;
};

std::shared_ptr<void> keep(std::vector<at::Tensor> t, std::shared_ptr<void> extra = {}) {
  return std::make_shared<Keep>(Keep{std::move(t), std::move(extra)});
}

// Runs `call`, a blocking MPI communicator constructor (MPI_Comm_dup, MPI_Comm_split), under the
// start-up watchdog (startup.h). They are collectives with no deadline (MPI 3 has no nonblocking
// split), and every member arriving first (the caller's barrier or allgather, which have
// deadlines) does not help when one is stopped between that and this call: measured on a loaded
// 2-core machine, a rank stopped 0.9 s into start-up held the other in MPI_Comm_split forever.
template <class F>
void within_deadline(const std::string& what, const WorldContext& ctx, double deadline_s, F call) {
  StartupPhase phase(what, deadline_s, ctx.launch);
  call();
}

std::string members_of(const std::vector<int>& world_ranks) {
  std::string s;
  for (int r : world_ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return "world ranks [" + s + "]";
}

}  // namespace

std::shared_ptr<MpiCommunicator> MpiCommunicator::create_world(
    const std::shared_ptr<WorldContext>& ctx, const CommOptions& options) {
  PARALLAX_CHECK(ctx->mpi, CommError,
                 "backend 'mpi' needs an MPI launch (mpirun, or srun with PMI), but this process "
                 "was started by {}; "
                 "use backend 'gloo' (CPU) or 'nccl' (GPU)",
                 ctx->launch.describe());
  // Every rank must arrive before the (blocking) MPI_Comm_dup: check that within the init timeout.
  MPI_Request req;
  MPI_Ibarrier(MPI_COMM_WORLD, &req);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(options.init_timeout_s));
  for (int done = 0, spins = 0;;) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (done) break;
    if (Clock::now() > deadline) {
      ctx->failed = true;
      throw_error<TimeoutError>(
          "creating the mpi world communicator timed out after {:.1f} s on world rank {}: not "
          "every rank arrived (init timeout){}",
          options.init_timeout_s, ctx->rank, startup_stragglers(ctx->launch));
    }
    if (++spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  MPI_Comm comm;
  within_deadline("creating the mpi world communicator (MPI_Comm_dup waits for every rank)", *ctx,
                  options.init_timeout_s, [&] { MPI_Comm_dup(MPI_COMM_WORLD, &comm); });
  std::vector<int> ranks(static_cast<size_t>(ctx->size));
  for (int i = 0; i < ctx->size; ++i) ranks[static_cast<size_t>(i)] = i;
  return std::make_shared<MpiCommunicator>(ctx, comm, "world", ctx->next_world_uid("mpi"),
                                           std::move(ranks), options);
}

MpiCommunicator::MpiCommunicator(std::shared_ptr<WorldContext> ctx, MPI_Comm comm, std::string name,
                                 std::string uid, std::vector<int> world_ranks, CommOptions options)
    : CommBase(std::move(ctx), std::move(name), std::move(uid), 0, std::move(world_ranks), options),
      comm_(comm) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  within_deadline(fmt::format("creating communicator '{}' (MPI_Comm_dup waits for {})", name_,
                              members_of(world_ranks_)),
                  *ctx_, options_.init_timeout_s, [&] {
                    MPI_Comm_dup(comm_, &p2p_);
                    MPI_Comm_dup(comm_, &ring_);
                  });
  void* ub = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
  if (flag && ub) tag_ub_ = *static_cast<int*>(ub);
  publish_created();
}

MpiCommunicator::~MpiCommunicator() {
  ctx_->unregister_comm(this);
  release_backend();
}

void MpiCommunicator::release_backend() noexcept {
  if (released_) return;
  released_ = true;
  int finalized = 0;
  MPI_Finalized(&finalized);
  // After an abort, requests may still reference the communicators: leave them to the runtime.
  if (finalized || aborted_) return;
  for (MPI_Comm* c : {&ring_, &p2p_, &comm_}) {
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
  }
}

void MpiCommunicator::check_mpi(int rc, const char* what) const {
  if (rc == MPI_SUCCESS) return;
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, buf, &len);
  throw_error<CommError>("{} on group '{}' (world rank {}): MPI error: {}", what, name_, ctx_->rank,
                         std::string(buf, static_cast<size_t>(len)));
}

void MpiCommunicator::check_op_dtype(const char* op, const at::Tensor& t, bool reduces) const {
  PARALLAX_CHECK(mpi_type(t.scalar_type()) != MPI_DATATYPE_NULL, CommError,
                 "{} on group '{}' (rank {}): dtype {} is not supported by the mpi backend "
                 "(float32/64, float16, "
                 "bfloat16, int64/32, int8/uint8, bool)",
                 op, name_, rank_, c10::toString(t.scalar_type()));
  PARALLAX_CHECK(!reduces || t.scalar_type() != c10::ScalarType::Bool, CommError,
                 "{} on group '{}' (rank {}): bool tensors cannot be reduced", op, name_, rank_);
}

WorkPtr MpiCommunicator::make_work(Ticket t, std::shared_ptr<std::vector<MPI_Request>> reqs,
                                   std::function<void()> on_done,
                                   std::shared_ptr<void> keep_alive) {
  auto poll = [reqs, this]() {
    int done = 0;
    check_mpi(MPI_Testall(static_cast<int>(reqs->size()), reqs->data(), &done, MPI_STATUSES_IGNORE),
              "MPI_Testall");
    return done != 0;
  };
  // The requests themselves must outlive an abandoned op too.
  auto both = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(
      std::move(keep_alive), reqs);
  return std::make_shared<PollWork>(shared_from_this(), std::move(t), std::move(poll),
                                    std::move(on_done), both);
}

WorkPtr MpiCommunicator::all_reduce_async(at::Tensor& tensor, ReduceOp op, CallSite site) {
  return all_reduce_async(tensor, op, options_.allreduce_algo, site);
}

WorkPtr MpiCommunicator::all_reduce_async(at::Tensor& tensor, ReduceOp op, AllReduceAlgo algo,
                                          CallSite site) {
  check_all_reduce_args("all_reduce", tensor);
  Ticket t = open_reduction(OpKind::kAllReduce, tensor, op, site, algo);
  const int n = size();
  if (n == 1 || tensor.numel() == 0) return complete_now(t);
  if (runs_as_ring(algo)) {
    const int tag_base = ring_tag_base(t.seq, 0, tag_ub_);  // the ring has its own MPI_Comm
    return start_ring_all_reduce(*this, std::move(t), tensor, op, tag_base, *this);
  }
  // MPI has no 16-bit float reduction: bf16/fp16 are reduced in a float32 staging copy.
  const bool staged = is_16bit_float(tensor.scalar_type());
  at::Tensor work = staged ? tensor.to(at::kFloat) : tensor;
  at::Tensor target = tensor;
  auto reqs = std::make_shared<std::vector<MPI_Request>>(1);
  check_mpi(
      MPI_Iallreduce(MPI_IN_PLACE, work.data_ptr(), count_of(*this, "all_reduce", work.numel()),
                     mpi_type(work.scalar_type()), mpi_op(op), comm_, &(*reqs)[0]),
      "MPI_Iallreduce");
  auto on_done = [staged, work, target, op, n]() mutable {
    if (op == ReduceOp::kAvg) divide_avg(work, n);
    if (staged) target.copy_(work);
  };
  return make_work(std::move(t), reqs, on_done, keep({work, target}));
}

WorkPtr MpiCommunicator::reduce_scatter_async(const at::Tensor& input, at::Tensor& output,
                                              ReduceOp op, CallSite site) {
  check_reduce_scatter_args(input, output);
  Ticket t = open_reduction(OpKind::kReduceScatter, input, op, site);
  const int n = size();
  const int64_t m = input.numel();
  if (m == 0) return complete_now(t);
  const bool staged = is_16bit_float(input.scalar_type());
  at::Tensor in = staged ? input.to(at::kFloat) : input;
  at::Tensor out = staged ? at::empty({output.numel()}, in.options()) : output;
  auto counts = std::make_shared<std::vector<int>>(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    (*counts)[static_cast<size_t>(r)] = count_of(*this, "reduce_scatter", chunk_numel(m, n, r));
  auto reqs = std::make_shared<std::vector<MPI_Request>>(1);
  check_mpi(MPI_Ireduce_scatter(in.data_ptr(), out.data_ptr(), counts->data(),
                                mpi_type(in.scalar_type()), mpi_op(op), comm_, &(*reqs)[0]),
            "MPI_Ireduce_scatter");
  at::Tensor target = output;
  auto on_done = [staged, out, target, op, n]() mutable {
    if (op == ReduceOp::kAvg) divide_avg(out, n);
    if (staged) target.copy_(out.view(target.sizes()));
  };
  return make_work(std::move(t), reqs, on_done, keep({in, out, target}, counts));
}

WorkPtr MpiCommunicator::all_gather_async(const at::Tensor& input, at::Tensor& output,
                                          CallSite site) {
  const int64_t total = check_all_gather_args(input, output);
  Ticket t = open_all_gather(OpKind::kAllGather, input, total, site);
  if (total == 0) return complete_now(t);
  const int n = size();
  auto cd = std::make_shared<std::vector<int>>(static_cast<size_t>(2 * n));
  for (int r = 0; r < n; ++r) {
    (*cd)[static_cast<size_t>(r)] = count_of(*this, "all_gather", chunk_numel(total, n, r));
    (*cd)[static_cast<size_t>(n + r)] = count_of(*this, "all_gather", chunk_offset(total, n, r));
  }
  const MPI_Datatype type = mpi_type(input.scalar_type());
  const auto* mine = static_cast<const char*>(output.data_ptr()) +
                     chunk_offset(total, n, rank_) * output.element_size();
  const void* send = input.data_ptr() == mine ? MPI_IN_PLACE : input.data_ptr();
  auto reqs = std::make_shared<std::vector<MPI_Request>>(1);
  check_mpi(MPI_Iallgatherv(send, static_cast<int>(input.numel()), type, output.data_ptr(),
                            cd->data(), cd->data() + n, type, comm_, &(*reqs)[0]),
            "MPI_Iallgatherv");
  return make_work(std::move(t), reqs, {}, keep({input, output}, cd));
}

WorkPtr MpiCommunicator::all_gather_async(const at::Tensor& input, std::vector<at::Tensor>& outputs,
                                          CallSite site) {
  const int64_t total = check_all_gather_args(input, outputs);
  Ticket t = open_all_gather(OpKind::kAllGatherList, input, total, site);
  if (total == 0) return complete_now(t);
  const int n = size();
  at::Tensor flat = at::empty({total}, input.options());
  auto cd = std::make_shared<std::vector<int>>(static_cast<size_t>(2 * n));
  int64_t off = 0;
  for (int r = 0; r < n; ++r) {
    (*cd)[static_cast<size_t>(r)] =
        count_of(*this, "all_gather", outputs[static_cast<size_t>(r)].numel());
    (*cd)[static_cast<size_t>(n + r)] = count_of(*this, "all_gather", off);
    off += outputs[static_cast<size_t>(r)].numel();
  }
  const MPI_Datatype type = mpi_type(input.scalar_type());
  auto reqs = std::make_shared<std::vector<MPI_Request>>(1);
  check_mpi(MPI_Iallgatherv(input.data_ptr(), static_cast<int>(input.numel()), type,
                            flat.data_ptr(), cd->data(), cd->data() + n, type, comm_, &(*reqs)[0]),
            "MPI_Iallgatherv");
  std::vector<at::Tensor> outs = outputs;
  auto on_done = [flat, outs]() mutable {
    int64_t o = 0;
    for (auto& out : outs) {
      out.copy_(flat.narrow(0, o, out.numel()).view(out.sizes()));
      o += out.numel();
    }
  };
  std::vector<at::Tensor> k = outs;
  k.push_back(flat);
  k.push_back(input);
  return make_work(std::move(t), reqs, on_done, keep(std::move(k), cd));
}

WorkPtr MpiCommunicator::broadcast_async(at::Tensor& tensor, int root, CallSite site) {
  check_broadcast_args(tensor, root);
  Ticket t = open_rooted(OpKind::kBroadcast, tensor, root, site);
  if (size() == 1 || tensor.numel() == 0) return complete_now(t);
  auto reqs = std::make_shared<std::vector<MPI_Request>>(1);
  check_mpi(MPI_Ibcast(tensor.data_ptr(), count_of(*this, "broadcast", tensor.numel()),
                       mpi_type(tensor.scalar_type()), root, comm_, &(*reqs)[0]),
            "MPI_Ibcast");
  return make_work(std::move(t), reqs, {}, keep({tensor}));
}

WorkPtr MpiCommunicator::send_async(const at::Tensor& tensor, int peer, int tag, CallSite site) {
  check_p2p_args("send", tensor, peer, tag);
  Ticket t = open_rooted(OpKind::kSend, tensor, peer, site, tag);
  auto reqs = std::make_shared<std::vector<MPI_Request>>(1);
  check_mpi(MPI_Isend(tensor.data_ptr(), count_of(*this, "send", tensor.numel()),
                      mpi_type(tensor.scalar_type()), peer, tag, p2p_, &(*reqs)[0]),
            "MPI_Isend");
  return make_work(std::move(t), reqs, {}, keep({tensor}));
}

WorkPtr MpiCommunicator::recv_async(at::Tensor& tensor, int peer, int tag, CallSite site) {
  check_p2p_args("recv", tensor, peer, tag);
  Ticket t = open_rooted(OpKind::kRecv, tensor, peer, site, tag);
  auto reqs = std::make_shared<std::vector<MPI_Request>>(1);
  check_mpi(MPI_Irecv(tensor.data_ptr(), count_of(*this, "recv", tensor.numel()),
                      mpi_type(tensor.scalar_type()), peer, tag, p2p_, &(*reqs)[0]),
            "MPI_Irecv");
  return make_work(std::move(t), reqs, {}, keep({tensor}));
}

WorkPtr MpiCommunicator::barrier_async(BarrierKind kind, CallSite site) {
  Ticket t = open_barrier(kind, site);
  if (size() == 1) return complete_now(t);
  auto reqs = std::make_shared<std::vector<MPI_Request>>(1);
  check_mpi(MPI_Ibarrier(comm_, &(*reqs)[0]), "MPI_Ibarrier");
  return make_work(std::move(t), reqs, {}, {});
}

std::unique_ptr<RingTransport::Request> MpiCommunicator::isend(const at::Tensor& t, int peer,
                                                               int tag) {
  MPI_Request r;
  check_mpi(MPI_Isend(t.data_ptr(), count_of(*this, "ring send", t.numel()),
                      mpi_type(t.scalar_type()), peer, tag, ring_, &r),
            "MPI_Isend (ring)");
  return std::make_unique<MpiRequest>(r);
}

std::unique_ptr<RingTransport::Request> MpiCommunicator::irecv(at::Tensor& t, int peer, int tag) {
  MPI_Request r;
  check_mpi(MPI_Irecv(t.data_ptr(), count_of(*this, "ring recv", t.numel()),
                      mpi_type(t.scalar_type()), peer, tag, ring_, &r),
            "MPI_Irecv (ring)");
  return std::make_unique<MpiRequest>(r);
}

std::vector<std::vector<uint8_t>> MpiCommunicator::allgather_bytes(const std::vector<uint8_t>& mine,
                                                                   const Ticket& t) {
  const int n = size();
  const int len = static_cast<int>(mine.size());
  std::vector<uint8_t> all(mine.size() * static_cast<size_t>(n));
  MPI_Request req;
  check_mpi(MPI_Iallgather(mine.data(), len, MPI_BYTE, all.data(), len, MPI_BYTE, comm_, &req),
            "MPI_Iallgather");
  int spins = 0;
  for (int done = 0;;) {
    check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
    if (done) break;
    if (Clock::now() > t.deadline) {
      // `all` is referenced by the pending request: keep it alive.
      ctx_->bury(std::make_shared<std::vector<uint8_t>>(std::move(all)));
      fail_timeout(t, t.desc.kind == OpKind::kSplit
                          ? ""
                          : " (in the debug_collectives descriptor exchange)");
    }
    if (++spins > 64) std::this_thread::yield();
  }
  std::vector<std::vector<uint8_t>> out(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    out[static_cast<size_t>(r)].assign(all.begin() + r * len, all.begin() + (r + 1) * len);
  return out;
}

std::shared_ptr<CommBase> MpiCommunicator::create_child(int color, const std::vector<int>& members,
                                                        const std::string& name,
                                                        const std::string& uid, const Ticket& t) {
  int key = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == rank_) key = static_cast<int>(i);
  }
  MPI_Comm child = MPI_COMM_NULL;
  within_deadline(
      fmt::format("creating communicator '{}' (MPI_Comm_split waits for every member of '{}': {})",
                  name, name_, members_of(world_ranks_)),
      *ctx_, options_.init_timeout_s, [&] {
        check_mpi(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &child),
                  "MPI_Comm_split");
      });
  if (color < 0 || child == MPI_COMM_NULL) return nullptr;
  std::vector<int> wr;
  for (int m : members) wr.push_back(world_ranks_[static_cast<size_t>(m)]);
  return std::make_shared<MpiCommunicator>(ctx_, child, name, uid, std::move(wr), options_);
}

}  // namespace parallax::comm::detail
