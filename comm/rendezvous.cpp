// How the ranks of a World meet (rendezvous.h): the store's creation and address exchange, the
// broadcast from rank 0 (WorldContext::broadcast_from_root) and the exit barrier.
#include "comm/rendezvous.h"

#include "comm/deadline_call.h"
#include "comm/op_desc.h"
#include "comm/startup.h"
#include "core/error.h"
#include "core/log.h"

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <mpi.h>
#include <unistd.h>

#include <cstdlib>
#include <thread>

namespace parallax::comm::detail {
namespace {

// Polls an MPI request until done or `timeout_s` passes (CommError naming `what`).
void mpi_wait_for(MPI_Request* req, double timeout_s, const std::string& what,
                  const LaunchInfo* launch = nullptr) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  int done = 0;
  int spins = 0;
  while (true) {
    MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (done) return;
    if (Clock::now() > deadline) {
      throw_error<TimeoutError>(
          "{} timed out after {:.1f} s (init timeout): not every rank arrived{}", what, timeout_s,
          launch ? startup_stragglers(*launch) : "");
    }
    if (++spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// Runs the store call `f` (which owns what it uses) until `deadline` (call_with_deadline): a
// TimeoutError names `what` when the store does not answer, a CommError carries a failing call's
// one-line text.
template <class F>
auto bounded_store_call(const char* what, Clock::time_point deadline, F f) -> decltype(f()) {
  try {
    if (auto r = call_with_deadline(std::move(f), deadline)) return *r;
  } catch (const std::exception& e) {
    throw_error<CommError>("the store failed during {}: {}", what, one_line_what(e));
  }
  throw_error<TimeoutError>("the store did not answer in time during {} (is its host stopped?)",
                            what);
}

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

std::chrono::milliseconds ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

}  // namespace

std::vector<uint8_t> WorldContext::broadcast_from_root(std::vector<uint8_t> bytes,
                                                       const std::string& key, double timeout_s) {
  if (size == 1) return bytes;
  if (mpi) {
    int64_t n = static_cast<int64_t>(bytes.size());
    MPI_Request req;
    MPI_Ibcast(&n, 1, MPI_INT64_T, 0, MPI_COMM_WORLD, &req);
    mpi_wait_for(&req, timeout_s, fmt::format("broadcast of '{}' from rank 0", key), &launch);
    bytes.resize(static_cast<size_t>(n));
    MPI_Ibcast(bytes.data(), static_cast<int>(n), MPI_BYTE, 0, MPI_COMM_WORLD, &req);
    mpi_wait_for(&req, timeout_s, fmt::format("broadcast of '{}' from rank 0", key));
    return bytes;
  }
  PARALLAX_CHECK(store, CommError, "rank {}: no MPI and no store to share '{}' from rank 0", rank,
                 key);
  const std::string k = "pxc/bcast/" + key;
  if (rank == 0) {
    store->set(k, bytes);
    return bytes;
  }
  try {
    store->wait({k}, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  } catch (const std::exception& e) {
    throw_error<TimeoutError>(
        "rank {}: waiting for '{}' from rank 0 through the store timed out after {:.1f} s: {}{}",
        rank, key, timeout_s, one_line_what(e), startup_stragglers(launch));
  }
  return store->get(k);
}

c10::intrusive_ptr<c10d::Store> make_store(WorldContext& ctx) {
  const LaunchInfo& l = ctx.launch;
  c10d::TCPStoreOptions o;
  o.timeout = ms(ctx.init_timeout_s);
  o.waitWorkers = false;
  o.numWorkers = static_cast<size_t>(ctx.size);
  if (!ctx.mpi && l.launcher != Launcher::kSingle) {
    // torchrun style: rank 0 hosts the store at MASTER_ADDR:MASTER_PORT (or the agent does).
    o.port = static_cast<uint16_t>(l.master_port);
    o.isServer = ctx.rank == 0 && !l.agent_store;
    try {
      auto tcp = c10::make_intrusive<c10d::TCPStore>(l.master_addr, o);
      if (!l.agent_store) return tcp;
      // The agent's store (torchrun's, or `parallax launch`'s) outlives restarts: each attempt's
      // keys live under /worker/attempt_<TORCHELASTIC_RESTART_COUNT>, as torchrun's workers put
      // them, so a restarted group never reads the previous group's keys.
      const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
      return c10::make_intrusive<c10d::PrefixStore>(
          fmt::format("/worker/attempt_{}", attempt && *attempt ? attempt : "0"), tcp);
    } catch (const std::exception& e) {
      throw_error<CommError>(
          "rank {}: cannot {} the TCPStore at {}:{} within {:.0f} s (init timeout): {}{}", ctx.rank,
          o.isServer ? "host" : "reach", l.master_addr, l.master_port, ctx.init_timeout_s,
          one_line_what(e), startup_stragglers(l));
    }
  }
  // MPI (or a single process): rank 0 hosts the store, its address travels through MPI.
  std::string advertised;
  const std::string me = host_name();
  if (const char* a = std::getenv("PARALLAX_STORE_ADDR"); a && *a) {
    advertised = a;
  } else if (const char* m = std::getenv("MASTER_ADDR"); m && *m) {
    advertised = m;
  } else {
    advertised = me;
  }
  c10::intrusive_ptr<c10d::Store> store;
  std::string msg;
  if (ctx.rank == 0) {
    o.isServer = true;
    o.port = 0;
    if (const char* p = std::getenv("PARALLAX_STORE_PORT"); p && *p)
      o.port = static_cast<uint16_t>(std::atoi(p));
    try {
      auto tcp = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);
      msg = fmt::format("{}\n{}\n{}", advertised, tcp->getPort(), me);
      store = tcp;
    } catch (const std::exception& e) {
      msg = fmt::format("!{}", one_line_what(e));
    }
  }
  std::vector<uint8_t> bytes(msg.begin(), msg.end());
  bytes = ctx.broadcast_from_root(std::move(bytes), "store", ctx.init_timeout_s);
  msg.assign(bytes.begin(), bytes.end());
  if (!msg.empty() && msg[0] == '!')
    throw_error<CommError>("rank 0 could not host the TCPStore: {}", msg.substr(1));
  if (ctx.rank == 0) return store;
  auto parts = std::vector<std::string>();
  size_t start = 0;
  for (size_t i = 0; i <= msg.size(); ++i) {
    if (i == msg.size() || msg[i] == '\n') {
      parts.push_back(msg.substr(start, i - start));
      start = i + 1;
    }
  }
  PARALLAX_CHECK(parts.size() == 3, CommError, "rank {}: malformed store address '{}' from rank 0",
                 ctx.rank, msg);
  const std::string addr = parts[2] == me ? std::string("127.0.0.1") : parts[0];
  o.isServer = false;
  o.port = static_cast<uint16_t>(std::atoi(parts[1].c_str()));
  try {
    return c10::make_intrusive<c10d::TCPStore>(addr, o);
  } catch (const std::exception& e) {
    throw_error<CommError>(
        "rank {}: cannot reach rank 0's TCPStore at {}:{} within {:.0f} s (set PARALLAX_STORE_ADDR "
        "to an address of rank 0's host reachable from here): {}",
        ctx.rank, addr, o.port, ctx.init_timeout_s, one_line_what(e));
  }
}

bool exit_barrier(const WorldContext& c, double timeout_s) {
  try {
    if (c.mpi) {
      MPI_Request req;
      MPI_Ibarrier(MPI_COMM_WORLD, &req);
      mpi_wait_for(&req, timeout_s, "world shutdown barrier");
    } else if (c.store) {
      // Two phases: everyone arrives, then everyone but rank 0 acknowledges having seen that, so
      // rank 0 (the store's host) is the last to stop using the store. Every store call is
      // bounded by the barrier's deadline (the store's host may be stopped).
      const auto deadline =
          Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
      auto add = [&](const char* key, int64_t n) {
        return bounded_store_call("a counter update", deadline,
                                  [s = c.store, k = std::string(key), n] { return s->add(k, n); });
      };
      add("pxc/exit", 1);
      while (add("pxc/exit", 0) < c.size && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      if (c.rank != 0) {
        add("pxc/exit_ack", 1);
      } else {
        while (add("pxc/exit_ack", 0) < c.size - 1 && Clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
      }
    }
  } catch (const std::exception& e) {
    // One line: the store's host may be gone (it exited first, or died); c10's backtrace is
    // not for users.
    core::log::warn("world shutdown barrier failed: {}", one_line_what(e));
    return false;
  }
  return true;
}

}  // namespace parallax::comm::detail
