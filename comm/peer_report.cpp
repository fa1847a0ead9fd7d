// The hang and straggler report of a failed op (CommBase::peer_report): which members of the
// group never arrived at the op, which are already past it, and which stopped responding at all.
// It reads what every rank publishes to the out-of-band store (SeqBoard: each rank's last issued
// collective per group, and a heartbeat), independently of the stuck op, so it works while the
// backend itself is wedged. Every store step is bounded: the store may live in the rank that
// stopped.
#include "comm/comm_base.h"

#include <c10/util/Exception.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <thread>

namespace parallax::comm::detail {
namespace {

// How long a hang report waits for the store (the peers' sequence numbers) before it reports what
// this rank knows: the store may live in a stopped or dead rank, whose calls never return.
constexpr std::chrono::milliseconds kReportStoreDeadline{10000};
// How long a peer's heartbeat must stall to be reported as not responding (6 heartbeats).
constexpr std::chrono::milliseconds kSilenceWindow{1500};

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

}  // namespace parallax::comm::detail
