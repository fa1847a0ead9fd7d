#include "comm/gloo_communicator.h"
#include "comm/deadline_call.h"
#include "comm/startup.h"

#include "comm/poll_work.h"
#include "comm/ring.h"
#include "core/error.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <thread>

namespace parallax::comm::detail {

namespace {

std::chrono::milliseconds ms(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
}

// gloo's own deadline sits a little after ours, so that our TimeoutError (with the hang report)
// comes first and gloo then releases its worker thread.
double gloo_timeout(double ours) {
  return ours + std::max(1.0, 0.1 * ours);
}

c10d::ReduceOp gloo_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
    case ReduceOp::kMax:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case ReduceOp::kMin:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
  }
  return c10d::ReduceOp(c10d::ReduceOp::SUM);
}

void divide_avg(at::Tensor& t, int n) {
  if (at::isIntegralType(t.scalar_type(), false)) {
    t.div_(n, "trunc");
  } else {
    t.div_(n);
  }
}

// Some c10d gloo works (send/recv, reduce-scatter) complete only inside their wait(), and a timed
// out wait ends a send/recv for good (gloo signals the timeout to the whole context), so they
// cannot be polled. Each watched work gets a thread of its own that blocks in its wait() and
// publishes the completion for the host polls. One thread for all, waiting in issue order, is not
// enough: a completion the host needs could then sit behind a send that completes only once the
// peer posts a receive, which the peer posts only after a completion of its own that sits behind
// a send waiting for us (1F1B's crossing messages deadlocked so on gloo, issue 36). Threads are
// kept for reuse; there are as many as works were ever pending at once. The destructor aborts the
// pending waits (Work::abort) and joins every thread.
class P2PWaiter {
 public:
  struct State {
    std::atomic<bool> done{false};
    std::exception_ptr error;  // written before done is set
  };

  P2PWaiter() = default;
  ~P2PWaiter() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      for (auto& item : queue_) abort_quietly(item.work);
      for (auto& w : active_) abort_quietly(w);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  P2PWaiter(const P2PWaiter&) = delete;
  P2PWaiter& operator=(const P2PWaiter&) = delete;

  std::shared_ptr<State> watch(c10::intrusive_ptr<c10d::Work> work, Clock::time_point deadline,
                               double slack_s) {
    auto state = std::make_shared<State>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({std::move(work),
                        deadline + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(slack_s)),
                        state});
      if (idle_ < queue_.size()) threads_.emplace_back([this] { run(); });
    }
    cv_.notify_one();
    return state;
  }

 private:
  // send/recv works stop waiting on abort(); collective works cannot be aborted (c10d throws), so
  // their wait ends at its own deadline.
  static void abort_quietly(const c10::intrusive_ptr<c10d::Work>& w) noexcept {
    try {
      w->abort();
    } catch (...) {
    }
  }

  struct Item {
    c10::intrusive_ptr<c10d::Work> work;
    Clock::time_point deadline;
    std::shared_ptr<State> state;
  };

  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      ++idle_;
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      --idle_;
      if (queue_.empty()) return;  // stop_ and drained
      Item item = std::move(queue_.front());
      queue_.pop_front();
      const auto mine = active_.insert(active_.end(), item.work);
      lock.unlock();
      try {
        auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(item.deadline - Clock::now());
        item.work->wait(std::max(left, std::chrono::milliseconds(1)));
      } catch (...) {
        item.state->error = std::current_exception();
      }
      item.state->done.store(true, std::memory_order_release);
      lock.lock();
      active_.erase(mine);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::list<c10::intrusive_ptr<c10d::Work>> active_;  // being waited for
  std::size_t idle_ = 0;                              // threads waiting for an item
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

bool p2p_done(const std::shared_ptr<P2PWaiter::State>& s) {
  if (!s->done.load(std::memory_order_acquire)) return false;
  if (s->error) std::rethrow_exception(s->error);
  return true;
}

class GlooRequest final : public RingTransport::Request {
 public:
  GlooRequest(c10::intrusive_ptr<c10d::Work> w, std::shared_ptr<P2PWaiter::State> s)
      : w_(std::move(w)), s_(std::move(s)) {}
  bool test() override { return p2p_done(s_); }

 private:
  c10::intrusive_ptr<c10d::Work> w_;
  std::shared_ptr<P2PWaiter::State> s_;
};

std::shared_ptr<::gloo::transport::Device> make_device(const WorldContext& ctx) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  // Every rank on one host: loopback is always reachable; otherwise the host name's address.
  if (ctx.launch.local_world_size == ctx.size)
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

struct Keep {
  std::vector<at::Tensor> tensors;
  c10::intrusive_ptr<c10d::Work> work;
  std::shared_ptr<void> extra;
};

class GlooCommunicator final : public CommBase, public RingTransport {
 public:
  GlooCommunicator(std::shared_ptr<WorldContext> ctx, c10::intrusive_ptr<c10d::ProcessGroupGloo> pg,
                   std::string name, std::string uid, int rank, std::vector<int> world_ranks,
                   CommOptions options)
      : CommBase(std::move(ctx), std::move(name), std::move(uid), rank, std::move(world_ranks),
                 options),
        pg_(std::move(pg)) {
    publish_created();
  }

  ~GlooCommunicator() override {
    ctx_->unregister_comm(this);
    release_backend();
  }

  // Creates a ProcessGroupGloo of `size` ranks under `uid` (blocks until every member joined).
  static c10::intrusive_ptr<c10d::ProcessGroupGloo> make_pg(const WorldContext& ctx,
                                                            const std::string& uid, int rank,
                                                            int size, const CommOptions& o) {
    PARALLAX_CHECK(ctx.store, CommError,
                   "backend 'gloo' needs the World's TCPStore, which is disabled or unavailable");
    auto opts = c10d::ProcessGroupGloo::Options::create(ms(o.init_timeout_s));
    opts->devices.push_back(make_device(ctx));
    opts->threads = 2;
    auto store = c10::make_intrusive<c10d::PrefixStore>("pxc/gloo/" + uid, ctx.store);
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
    pg->setTimeout(ms(gloo_timeout(o.timeout_s)));
    return pg;
  }

  std::string backend() const override { return "gloo"; }
  c10::DeviceType device_type() const override { return c10::DeviceType::CPU; }

  WorkPtr all_reduce_async(at::Tensor& tensor, ReduceOp op, CallSite site) override {
    return all_reduce_async(tensor, op, options_.allreduce_algo, site);
  }

  WorkPtr all_reduce_async(at::Tensor& tensor, ReduceOp op, AllReduceAlgo algo,
                           CallSite site) override {
    check_all_reduce_args("all_reduce", tensor);
    Ticket t = open_reduction(OpKind::kAllReduce, tensor, op, site, algo);
    const int n = size();
    if (n == 1 || tensor.numel() == 0) return complete_now(t);
    if (runs_as_ring(algo)) {
      // The ring's tags lie above the user's point-to-point tags of the same process group.
      const int tag_base = ring_tag_base(t.seq, kMaxUserTag, INT32_MAX - kMaxUserTag);
      return start_ring_all_reduce(*this, std::move(t), tensor, op, tag_base, *this);
    }
    at::Tensor target = tensor;
    std::vector<at::Tensor> v{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = gloo_op(op);
    o.timeout = ms(gloo_timeout(t.timeout_s));
    auto w = start(t, [&] { return pg_->allreduce(v, o); });
    auto on_done = [target, op, n]() mutable {
      if (op == ReduceOp::kAvg) divide_avg(target, n);
    };
    return make_work(std::move(t), w, on_done, {target});
  }

  WorkPtr reduce_scatter_async(const at::Tensor& input, at::Tensor& output, ReduceOp op,
                               CallSite site) override {
    check_reduce_scatter_args(input, output);
    Ticket t = open_reduction(OpKind::kReduceScatter, input, op, site);
    const int n = size();
    const int64_t m = input.numel();
    if (m == 0) return complete_now(t);
    if (n == 1) {
      output.view({-1}).copy_(input.view({-1}));
      return complete_now(t);
    }
    // gloo's reduce_scatter_base needs equal chunks: pad every chunk to the largest one.
    const int64_t p = chunk_numel(m, n, 0);
    at::Tensor in = input.view({-1});
    if (m % n != 0) {
      at::Tensor padded = at::zeros({n * p}, input.options());
      for (int r = 0; r < n; ++r) {
        padded.narrow(0, r * p, chunk_numel(m, n, r))
            .copy_(in.narrow(0, chunk_offset(m, n, r), chunk_numel(m, n, r)));
      }
      in = padded;
    }
    at::Tensor out = at::empty({p}, input.options());
    c10d::ReduceScatterOptions o;
    o.reduceOp = gloo_op(op);
    o.timeout = ms(gloo_timeout(t.timeout_s));
    auto w = start(t, [&] { return pg_->_reduce_scatter_base(out, in, o); });
    at::Tensor target = output;
    auto on_done = [out, target, op, n]() mutable {
      at::Tensor mine = out.narrow(0, 0, target.numel());
      if (op == ReduceOp::kAvg) divide_avg(mine, n);
      target.view({-1}).copy_(mine);
    };
    return make_work(std::move(t), w, on_done, {in, out, target});
  }

  WorkPtr all_gather_async(const at::Tensor& input, at::Tensor& output, CallSite site) override {
    const int64_t total = check_all_gather_args(input, output);
    Ticket t = open_all_gather(OpKind::kAllGather, input, total, site);
    if (total == 0) return complete_now(t);
    const int n = size();
    std::vector<int64_t> sizes(static_cast<size_t>(n));
    for (int r = 0; r < n; ++r) sizes[static_cast<size_t>(r)] = chunk_numel(total, n, r);
    std::vector<at::Tensor> outs;
    at::Tensor flat_out = output.view({-1});
    for (int r = 0; r < n; ++r)
      outs.push_back(flat_out.narrow(0, chunk_offset(total, n, r), sizes[static_cast<size_t>(r)]));
    return gather_padded(std::move(t), input, sizes, outs, output);
  }

  WorkPtr all_gather_async(const at::Tensor& input, std::vector<at::Tensor>& outputs,
                           CallSite site) override {
    const int64_t total = check_all_gather_args(input, outputs);
    Ticket t = open_all_gather(OpKind::kAllGatherList, input, total, site);
    if (total == 0) return complete_now(t);
    std::vector<int64_t> sizes;
    std::vector<at::Tensor> outs;
    for (auto& o : outputs) {
      sizes.push_back(o.numel());
      outs.push_back(o.view({-1}));
    }
    return gather_padded(std::move(t), input, sizes, outs, at::Tensor());
  }

  WorkPtr broadcast_async(at::Tensor& tensor, int root, CallSite site) override {
    check_broadcast_args(tensor, root);
    Ticket t = open_rooted(OpKind::kBroadcast, tensor, root, site);
    if (size() == 1 || tensor.numel() == 0) return complete_now(t);
    std::vector<at::Tensor> v{tensor};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = ms(gloo_timeout(t.timeout_s));
    auto w = start(t, [&] { return pg_->broadcast(v, o); });
    return make_work(std::move(t), w, {}, {tensor});
  }

  WorkPtr send_async(const at::Tensor& tensor, int peer, int tag, CallSite site) override {
    check_p2p_args("send", tensor, peer, tag);
    Ticket t = open_rooted(OpKind::kSend, tensor, peer, site, tag);
    std::vector<at::Tensor> v{tensor};
    auto w = start(t, [&] { return pg_->send(v, peer, tag); });
    return make_work(std::move(t), w, {}, {tensor});
  }

  WorkPtr recv_async(at::Tensor& tensor, int peer, int tag, CallSite site) override {
    check_p2p_args("recv", tensor, peer, tag);
    Ticket t = open_rooted(OpKind::kRecv, tensor, peer, site, tag);
    std::vector<at::Tensor> v{tensor};
    auto w = start(t, [&] { return pg_->recv(v, peer, tag); });
    return make_work(std::move(t), w, {}, {tensor});
  }

  WorkPtr barrier_async(BarrierKind kind, CallSite site) override {
    Ticket t = open_barrier(kind, site);
    if (size() == 1) return complete_now(t);
    c10d::BarrierOptions o;
    o.timeout = ms(gloo_timeout(t.timeout_s));
    auto w = start(t, [&] { return pg_->barrier(o); });
    return make_work(std::move(t), w, {}, {});
  }

  std::unique_ptr<Request> isend(const at::Tensor& t, int peer, int tag) override {
    std::vector<at::Tensor> v{t};
    auto w = pg_->send(v, peer, tag);
    return std::make_unique<GlooRequest>(w, waiter().watch(w, ring_deadline(), slack()));
  }

  std::unique_ptr<Request> irecv(at::Tensor& t, int peer, int tag) override {
    std::vector<at::Tensor> v{t};
    auto w = pg_->recv(v, peer, tag);
    return std::make_unique<GlooRequest>(w, waiter().watch(w, ring_deadline(), slack()));
  }

  void release_backend() noexcept override {
    waiter_.reset();  // aborts p2p waits still pending
    if (aborted_ && pg_) {
      // A worker thread may still sit in the timed-out op until gloo's own deadline (ours plus a
      // little); the World releases the process group at shutdown instead of blocking here.
      ctx_->bury(std::make_shared<c10::intrusive_ptr<c10d::ProcessGroupGloo>>(std::move(pg_)));
    }
    pg_.reset();
  }

 protected:
  // Starts a gloo op: gloo throws at once when the connection to a peer is already closed (a
  // killed rank; its send() and recv() post synchronously), which becomes this op's failure,
  // named like any other (op, group, rank, peer; flight recorder), not gloo's bare message.
  template <class Start>
  c10::intrusive_ptr<c10d::Work> start(const Ticket& t, Start&& start_op) {
    try {
      return start_op();
    } catch (const std::exception& e) {
      fail_error(t, e.what());
    }
  }

  std::vector<std::vector<uint8_t>> allgather_bytes(const std::vector<uint8_t>& mine,
                                                    const Ticket& t) override {
    const int n = size();
    const int64_t len = static_cast<int64_t>(mine.size());
    at::Tensor in = at::empty({len}, at::kByte);
    std::memcpy(in.data_ptr(), mine.data(), mine.size());
    at::Tensor out = at::empty({n * len}, at::kByte);
    c10d::AllgatherOptions o;
    o.timeout = ms(gloo_timeout(t.timeout_s));
    auto w = pg_->_allgather_base(out, in, o);
    auto state = waiter().watch(w, t.deadline, slack());
    int spins = 0;
    while (true) {
      bool done = false;
      try {
        done = p2p_done(state);
      } catch (const std::exception& e) {
        fail_error(t, e.what());
      }
      if (done) break;
      if (Clock::now() > t.deadline) {
        ctx_->bury(std::make_shared<Keep>(Keep{{in, out}, w, state}));
        fail_timeout(t, t.desc.kind == OpKind::kSplit
                            ? ""
                            : " (in the debug_collectives descriptor exchange)");
      }
      if (++spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    std::vector<std::vector<uint8_t>> res(static_cast<size_t>(n));
    const auto* p = out.data_ptr<uint8_t>();
    for (int r = 0; r < n; ++r) res[static_cast<size_t>(r)].assign(p + r * len, p + (r + 1) * len);
    return res;
  }

  std::shared_ptr<CommBase> create_child(int color, const std::vector<int>& members,
                                         const std::string& name, const std::string& uid,
                                         const Ticket& t) override {
    if (color < 0) return nullptr;
    int me = -1;
    std::vector<int> wr;
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i] == rank_) me = static_cast<int>(i);
      wr.push_back(world_ranks_[static_cast<size_t>(members[i])]);
    }
    c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
    try {
      pg = make_pg(*ctx_, uid, me, static_cast<int>(members.size()), options_);
      // A member that returns while a peer is still connecting, and then drops the group, breaks
      // the peer's connectFullMesh: leave only once every member is connected.
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t.deadline - Clock::now());
      pg->barrier()->wait(std::max(left, std::chrono::milliseconds(1)));
    } catch (const std::exception& e) {
      fail_error(t, fmt::format("creating the gloo group '{}' failed: {}", name,
                                std::string(e.what()).substr(0, 400)));
    }
    return std::make_shared<GlooCommunicator>(ctx_, std::move(pg), name, uid, me, std::move(wr),
                                              options_);
  }

  void abort_backend() noexcept override {}

  void check_op_dtype(const char* op, const at::Tensor& t, bool reduces) const override {
    switch (t.scalar_type()) {
      case c10::ScalarType::Float:
      case c10::ScalarType::Double:
      case c10::ScalarType::Half:
      case c10::ScalarType::BFloat16:
      case c10::ScalarType::Long:
      case c10::ScalarType::Int:
      case c10::ScalarType::Byte:
      case c10::ScalarType::Char:
        return;
      case c10::ScalarType::Bool:
        if (!reduces) return;
        [[fallthrough]];
      default:
        throw_error<CommError>(
            "{} on group '{}' (rank {}): dtype {} is not supported by the gloo backend{}", op,
            name_, rank_, c10::toString(t.scalar_type()), reduces ? " for reductions" : "");
    }
  }

 private:
  // Every c10d work is completed through the waiter thread: some gloo works (send/recv, the
  // reduce-scatter) only make progress or report completion inside their wait().
  WorkPtr make_work(Ticket t, c10::intrusive_ptr<c10d::Work> w, std::function<void()> on_done,
                    std::vector<at::Tensor> tensors) {
    auto state = waiter().watch(w, t.deadline, slack());
    auto poll = [state] { return p2p_done(state); };
    return std::make_shared<PollWork>(shared_from_this(), std::move(t), std::move(poll),
                                      std::move(on_done),
                                      std::make_shared<Keep>(Keep{std::move(tensors), w, state}));
  }

  // All-gather of per-rank pieces of `sizes[r]` elements into `outs[r]`, padded to the largest.
  WorkPtr gather_padded(Ticket t, const at::Tensor& input, const std::vector<int64_t>& sizes,
                        std::vector<at::Tensor> outs, at::Tensor keep_output) {
    const int n = size();
    const int64_t p = *std::max_element(sizes.begin(), sizes.end());
    at::Tensor in = at::zeros({p}, input.options());
    in.narrow(0, 0, input.numel()).copy_(input.view({-1}));
    at::Tensor out = at::empty({n * p}, input.options());
    c10d::AllgatherOptions o;
    o.timeout = ms(gloo_timeout(t.timeout_s));
    auto w = start(t, [&] { return pg_->_allgather_base(out, in, o); });
    auto on_done = [out, outs, sizes, p]() mutable {
      for (size_t r = 0; r < outs.size(); ++r) {
        outs[r].copy_(out.narrow(0, static_cast<int64_t>(r) * p, sizes[r]));
      }
    };
    std::vector<at::Tensor> k = outs;
    k.push_back(in);
    k.push_back(out);
    if (keep_output.defined()) k.push_back(keep_output);
    return make_work(std::move(t), w, on_done, std::move(k));
  }

  P2PWaiter& waiter() {
    if (!waiter_) waiter_ = std::make_unique<P2PWaiter>();
    return *waiter_;
  }
  // Ring messages wait at most one steady-state timeout (the ring op's own deadline fires first).
  Clock::time_point ring_deadline() const {
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(options_.timeout_s));
  }
  double slack() const { return gloo_timeout(options_.timeout_s) - options_.timeout_s; }

  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  std::unique_ptr<P2PWaiter> waiter_;
};

}  // namespace

CommPtr make_gloo_world(const std::shared_ptr<WorldContext>& ctx, const CommOptions& options) {
  const std::string uid = ctx->next_world_uid("gloo");
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  try {
    pg = GlooCommunicator::make_pg(*ctx, uid, ctx->rank, ctx->size, options);
    // As for a child group (create_child): a rank whose side of connectFullMesh finished first,
    // and which then drops the communicator (a run that stops on a config error at once), closes
    // the connection a slower peer is still setting up ("Connection closed by peer", seen in CI:
    // zero_gloo_np2, 2026-11-30). Leave only once every rank is connected.
    pg->barrier()->wait(std::chrono::milliseconds(
        std::max<int64_t>(1, static_cast<int64_t>(options.init_timeout_s * 1000))));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    ctx->failed = true;
    throw_error<TimeoutError>(
        "creating the gloo world communicator failed on world rank {} within the init timeout "
        "({:.0f} s): {}{}",
        ctx->rank, options.init_timeout_s, one_line_what(e), startup_stragglers(ctx->launch));
  }
  std::vector<int> ranks(static_cast<size_t>(ctx->size));
  for (int i = 0; i < ctx->size; ++i) ranks[static_cast<size_t>(i)] = i;
  return std::make_shared<GlooCommunicator>(ctx, std::move(pg), "world", uid, ctx->rank,
                                            std::move(ranks), options);
}

}  // namespace parallax::comm::detail
