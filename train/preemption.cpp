#include "train/preemption.h"

#include "comm/communicator.h"
#include "core/error.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <time.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <exception>
#include <optional>
#include <thread>

namespace parallax::train {
namespace {

constexpr int64_t kDuplicateWindowMs = 2000;
std::atomic<int> g_signal{0};  // first preemption signal (0: none); lock-free, so signal-safe
std::atomic<bool> g_preempted{false};
std::atomic<bool> g_installed{false};
static_assert(std::atomic<int>::is_always_lock_free);

void write_stderr(const char* text) {
  // write(2) is async-signal-safe; a short write of a diagnostic line is acceptable.
  const ssize_t n = ::write(STDERR_FILENO, text, std::strlen(text));
  (void)n;
}

int64_t monotonic_ms() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe
  return static_cast<int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

std::atomic<int64_t> g_first_ms{0};
constexpr const char* kTrainAction = "stopping after the current step (checkpoint, then exit 143)";
std::atomic<const char*> g_action{kTrainAction};  // what the handler says the first signal does
static_assert(std::atomic<int64_t>::is_always_lock_free);

extern "C" void on_preemption_signal(int sig) {
  int expected = 0;
  if (!g_signal.compare_exchange_strong(expected, sig)) {
    // A copy of the same preemption (Slurm signals every process of the step, and the launcher
    // forwards its own) arrives within the window: it is not a "second signal".
    if (monotonic_ms() - g_first_ms.load() < kDuplicateWindowMs) return;
    // Second signal: the default action (terminate) at once.
    write_stderr("parallax: second signal: exiting now without a checkpoint\n");
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  g_first_ms = monotonic_ms();
  write_stderr(sig == SIGINT ? "parallax: SIGINT received: " : "parallax: SIGTERM received: ");
  write_stderr(g_action.load());
  write_stderr("; send it again to exit now\n");
}

}  // namespace

struct PreemptionSignals::Saved {
  struct sigaction term {};
  struct sigaction intr {};
};

PreemptionSignals::PreemptionSignals(const char* action) : saved_(std::make_unique<Saved>()) {
  g_action = action ? action : kTrainAction;
  g_signal = 0;
  g_preempted = false;
  struct sigaction sa {};
  sa.sa_handler = on_preemption_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // blocking reads and waits continue; the loop polls the flag
  ::sigaction(SIGTERM, &sa, &saved_->term);
  ::sigaction(SIGINT, &sa, &saved_->intr);
  g_installed = true;
}

PreemptionSignals::~PreemptionSignals() {
  g_installed = false;
  ::sigaction(SIGTERM, &saved_->term, nullptr);
  ::sigaction(SIGINT, &saved_->intr, nullptr);
}

bool PreemptionSignals::installed() {
  return g_installed.load();
}

bool PreemptionSignals::requested() {
  return g_signal.load() != 0;
}
int PreemptionSignals::signal_number() {
  return g_signal.load();
}
void PreemptionSignals::request_for_test() {
  int expected = 0;
  g_signal.compare_exchange_strong(expected, SIGTERM);
}

bool preempted() {
  return g_preempted.load();
}
void mark_preempted() {
  g_preempted = true;
}

// ---- PreemptionVote --------------------------------------------------------------------------

struct PreemptionVote::State {
  comm::Communicator* world = nullptr;
  c10::Device device{c10::kCPU};
  double timeout_s = 300;
  at::Tensor flag;  // on the communicator's device; reduced in place
  at::Tensor host;  // pinned copy of `flag` (CUDA only)
  comm::WorkPtr work;
  std::optional<c10::Event> copied;  // CUDA: recorded after the copy into `host`
  bool pending_local = false;        // world of one rank: the previous call's flag
};

PreemptionVote::PreemptionVote(comm::Communicator& world, c10::Device device, double timeout_s)
    : s_(std::make_unique<State>()) {
  s_->world = &world;
  s_->device = world.device_type() == c10::kCPU ? c10::Device(c10::kCPU) : device;
  s_->timeout_s = timeout_s;
}

PreemptionVote::~PreemptionVote() {
  if (!s_ || !s_->work) return;
  if (std::uncaught_exceptions() > 0) {
    // Unwinding from a failure (often a failed collective): waiting for the outstanding vote could
    // block for a whole collective timeout. Its buffers must outlive the backend's use of them, so
    // they are left allocated; the process is on its way to an error exit.
    (void)s_.release();
    return;
  }
  s_->work->wait();
}

bool PreemptionVote::should_stop() {
  auto& s = *s_;
  bool stop = false;
  if (s.work) {
    s.work->wait();
    if (s.device.is_cuda()) {
      const auto deadline = std::chrono::steady_clock::now() +
                            std::chrono::milliseconds(static_cast<int64_t>(s.timeout_s * 1000));
      while (!s.copied->query()) {
        PARALLAX_CHECK(std::chrono::steady_clock::now() < deadline, TimeoutError,
                       "preemption vote: rank {}: the vote's copy to the host did not finish "
                       "within {:.0f} s",
                       s.world->rank(), s.timeout_s);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      stop = s.host.item<float>() > 0;
    } else {
      stop = s.flag.item<float>() > 0;
    }
    s.work.reset();
  }
  if (stop) return true;
  const float mine = PreemptionSignals::requested() ? 1.f : 0.f;
  if (s.world->size() == 1) {
    // No peers: the local flag is the vote, reported one call later like the collective's.
    const bool stop_now = s.pending_local;
    s.pending_local = mine > 0;
    return stop_now;
  }
  if (s.device.is_cuda()) {
    s.flag = at::full({1}, mine, at::TensorOptions().dtype(at::kFloat).device(s.device));
    s.work = s.world->all_reduce_async(s.flag, comm::ReduceOp::kMax, comm::AllReduceAlgo::kNative);
    s.work->wait_stream();  // the copy below is ordered after the all-reduce, the host not
    if (!s.host.defined())
      s.host = at::empty({1}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
    s.host.copy_(s.flag, /*non_blocking=*/true);
    c10::impl::VirtualGuardImpl impl(s.device.type());
    if (!s.copied) s.copied.emplace(s.device.type());
    s.copied->record(impl.getStream(s.device));
  } else {
    s.flag = at::full({1}, mine, at::TensorOptions().dtype(at::kFloat));
    s.work = s.world->all_reduce_async(s.flag, comm::ReduceOp::kMax, comm::AllReduceAlgo::kNative);
  }
  return false;
}

}  // namespace parallax::train
