// The schedule builders: each kind's compute order per rank (the literature's loops over
// micro-batches), then with_comm() places the messages around it where Megatron-LM posts them.
#include "parallel/pipeline/schedule.h"

#include "core/enum_names.h"
#include "core/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace parallax::parallel::pipeline {

namespace {

// The compute order of one rank, before the communication is inserted.
using Order = std::vector<Op>;

Op compute(OpKind k, int micro, int stage) {
  return Op{k, micro, stage, -1};
}

std::vector<Order> gpipe_order(int p, int m) {
  std::vector<Order> out(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    for (int i = 0; i < m; ++i) out[r].push_back(compute(OpKind::kForward, i, r));
    for (int i = 0; i < m; ++i) out[r].push_back(compute(OpKind::kBackward, i, r));
  }
  return out;
}

std::vector<Order> one_f_one_b_order(int p, int m) {
  std::vector<Order> out(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    const int warm = std::min(p - r - 1, m);
    for (int i = 0; i < warm; ++i) out[r].push_back(compute(OpKind::kForward, i, r));
    for (int i = 0; i < m - warm; ++i) {
      out[r].push_back(compute(OpKind::kForward, warm + i, r));
      out[r].push_back(compute(OpKind::kBackward, i, r));
    }
    for (int i = m - warm; i < m; ++i) out[r].push_back(compute(OpKind::kBackward, i, r));
  }
  return out;
}

// Megatron-LM's interleaved 1F1B (forward_backward_pipelining_with_interleaving): the k-th
// forward of every rank is micro-batch (k / (p v)) p + k % p of chunk (k / p) % v; backwards walk
// the chunks in reverse. Warm-up: 2 (p - r - 1) + (v - 1) p forwards (all of them when m == p).
std::vector<Order> interleaved_order(int p, int m, int v, std::vector<std::vector<bool>>& joined) {
  std::vector<Order> out(static_cast<std::size_t>(p));
  joined.assign(static_cast<std::size_t>(p), {});
  const int total = m * v;
  const auto micro_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  const auto chunk_of = [&](int k, bool fwd) {
    const int c = (k % (p * v)) / p;
    return fwd ? c : v - 1 - c;
  };
  for (int r = 0; r < p; ++r) {
    int warm = m == p ? total : std::min(total, 2 * (p - r - 1) + (v - 1) * p);
    const auto f = [&](int k) {
      return compute(OpKind::kForward, micro_of(k), chunk_of(k, true) * p + r);
    };
    const auto b = [&](int k) {
      return compute(OpKind::kBackward, micro_of(k), chunk_of(k, false) * p + r);
    };
    for (int k = 0; k < warm; ++k) out[r].push_back(f(k));
    joined[r].assign(static_cast<std::size_t>(2 * total), false);
    for (int k = 0; k < total - warm; ++k) {
      // A steady-state pair: no communication between its F and B (module comment of with_comm).
      joined[r][out[r].size()] = true;
      out[r].push_back(f(warm + k));
      out[r].push_back(b(k));
    }
    for (int k = total - warm; k < total; ++k) out[r].push_back(b(k));
  }
  return out;
}

// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): 1F1B's order of F and B (B being
// the input-gradient pass only), with W's deferred. Rank r keeps up to r W's pending (the paper's
// shifted W start: the first rank runs each W right after its B, the last defers pp - 1 of them)
// and runs a pending W whenever its next F or B is not ready, so the W's fill the warm-up and
// cool-down waits and the critical path (the F's down, the B's up) never waits for a W. The plan's
// bubble with F = B = W = 1 is then the paper's (p - 1) / (3 m) for m >= p. Memory: rank r holds
// at most pp - r micro-batches between F and B (1F1B's) plus r + 1 awaiting W, so pp micro-batches
// at most on every rank: the first rank's 1F1B bound, which is 1F1B's peak. The placement comes
// from a simulation with F = B = W = 1, so the plan is static.
std::vector<Order> zb_h1_order(int p, int m) {
  const std::vector<Order> base = one_f_one_b_order(p, m);
  std::vector<Order> out(static_cast<std::size_t>(p));
  std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
  std::vector<double> clock(static_cast<std::size_t>(p), 0);
  std::vector<std::vector<int>> pending(static_cast<std::size_t>(p));  // micro-batches awaiting W
  std::map<std::pair<int, int>, double> f_end, b_end;                  // (micro, stage) -> time
  const auto ready_at = [&](const Op& op) -> double {                  // < 0: unknown yet
    if (op.kind == OpKind::kForward) {
      if (op.stage == 0) return 0;
      const auto it = f_end.find({op.micro, op.stage - 1});
      return it == f_end.end() ? -1 : it->second;
    }
    const auto own = f_end.find({op.micro, op.stage});
    if (own == f_end.end()) return -1;
    if (op.stage == p - 1) return own->second;
    const auto it = b_end.find({op.micro, op.stage + 1});
    return it == b_end.end() ? -1 : std::max(own->second, it->second);
  };
  const auto done = [&](int r) { return next[r] == base[r].size() && pending[r].empty(); };
  for (int guard = 0; guard < 16 * p * m + 16; ++guard) {
    // The rank that decides next: the earliest clock among those with work left.
    int r = -1;
    for (int q = 0; q < p; ++q)
      if (!done(q) && (r < 0 || clock[q] < clock[r])) r = q;
    if (r < 0) return out;
    const int limit = r;
    if (next[r] == base[r].size() || static_cast<int>(pending[r].size()) > limit) {
      // Nothing left but W's, or more pending than the bound: run the oldest W now.
      const int micro = pending[r].front();
      pending[r].erase(pending[r].begin());
      out[r].push_back(compute(OpKind::kWeight, micro, r));
      clock[r] += 1;
      continue;
    }
    const Op& op = base[r][next[r]];
    const double ready = ready_at(op);
    if (ready >= 0 && ready <= clock[r]) {
      out[r].push_back(op);
      clock[r] += 1;
      (op.kind == OpKind::kForward ? f_end : b_end)[{op.micro, op.stage}] = clock[r];
      if (op.kind == OpKind::kBackward) pending[r].push_back(op.micro);
      ++next[r];
    } else if (!pending[r].empty()) {
      // Waiting for a neighbour (an unknown time is later than this clock: every other rank's
      // clock is at least this one): fill the wait with a deferred W.
      const int micro = pending[r].front();
      pending[r].erase(pending[r].begin());
      out[r].push_back(compute(OpKind::kWeight, micro, r));
      clock[r] += 1;
    } else {
      // Idle until the input arrives, or until the next rank's clock moves past this one.
      double t = ready >= 0 ? ready : -1;
      if (t < 0) {
        for (int q = 0; q < p; ++q)
          if (q != r && !done(q) && clock[q] > clock[r] && (t < 0 || clock[q] < t)) t = clock[q];
      }
      clock[r] = t > clock[r] ? t : clock[r] + 1;
    }
  }
  throw_error<Error>(
      "pipeline plan 'zb': the placement of the W passes did not converge for pp={}, "
      "{} micro-batches (a bug: please report it)",
      p, m);
}

// The communication around the compute ops. Batches sit at the boundaries between consecutive
// compute ops (boundary j: right before op j; n: after the last), except where `joined[j]` says op
// j and op j + 1 run back to back. A receive goes into the last batch before the op that needs it,
// a send into the first batch after the op that produced it. With every boundary open this is
// Megatron's 1F1B pairing (send_forward_recv_backward, send_backward_recv_forward); interleaving
// joins each steady-state F with its B, so the four transfers of the pair go in one batch after
// it (Megatron's send_forward_backward_recv_forward_backward): with separate batches two
// neighbours each wait inside a batch for the other's next one, a deadlock under rendezvous.
std::vector<Op> with_comm(const Schedule& s, const Order& order, const std::vector<bool>& joined) {
  const int last = s.stages() - 1;
  const int n = static_cast<int>(order.size());
  const auto open = [&](int b) {  // boundary b (0..n) can hold a batch
    return b == 0 || b == n || joined.empty() || !joined[static_cast<std::size_t>(b - 1)];
  };
  std::vector<std::vector<Op>> sends(static_cast<std::size_t>(n) + 1),
      recvs(static_cast<std::size_t>(n) + 1);
  for (int j = 0; j < n; ++j) {
    const Op& op = order[j];
    int before = j;
    while (!open(before)) --before;
    int after = j + 1;
    while (!open(after)) ++after;
    if (op.kind == OpKind::kForward) {
      if (op.stage > 0)
        recvs[before].push_back(
            {OpKind::kRecvAct, op.micro, op.stage - 1, s.rank_of(op.stage - 1)});
      if (op.stage < last)
        sends[after].push_back({OpKind::kSendAct, op.micro, op.stage, s.rank_of(op.stage + 1)});
    } else if (op.kind == OpKind::kBackward) {
      if (op.stage < last)
        recvs[before].push_back(
            {OpKind::kRecvGrad, op.micro, op.stage + 1, s.rank_of(op.stage + 1)});
      if (op.stage > 0)
        sends[after].push_back({OpKind::kSendGrad, op.micro, op.stage, s.rank_of(op.stage - 1)});
    }
  }
  std::vector<Op> out;
  for (int b = 0; b <= n; ++b) {
    out.insert(out.end(), sends[b].begin(), sends[b].end());
    out.insert(out.end(), recvs[b].begin(), recvs[b].end());
    if (b < n) out.push_back(order[b]);
  }
  return out;
}

}  // namespace

std::string to_string(const Op& op) {
  switch (op.kind) {
    case OpKind::kForward:
    case OpKind::kBackward:
    case OpKind::kWeight:
      return fmt::format("{}{}s{}", to_string(op.kind), op.micro, op.stage);
    case OpKind::kSendAct:
    case OpKind::kSendGrad:
      return fmt::format("{} m{} s{} -> r{}", to_string(op.kind), op.micro, op.stage, op.peer);
    default:
      return fmt::format("{} m{} s{} <- r{}", to_string(op.kind), op.micro, op.stage, op.peer);
  }
}

const char* to_string(OpKind kind) {
  switch (kind) {
    case OpKind::kForward:
      return "F";
    case OpKind::kBackward:
      return "B";
    case OpKind::kWeight:
      return "W";
    case OpKind::kSendAct:
      return "send act";
    case OpKind::kRecvAct:
      return "recv act";
    case OpKind::kSendGrad:
      return "send grad";
    case OpKind::kRecvGrad:
      return "recv grad";
  }
  return "?";
}

namespace {
constexpr core::EnumName<ScheduleKind> kScheduleKinds[] = {
    {ScheduleKind::kGpipe, "gpipe"},
    {ScheduleKind::k1F1B, "1f1b"},
    {ScheduleKind::kInterleaved, "interleaved"},
    {ScheduleKind::kZb, "zb"},
};
}  // namespace

const char* to_string(ScheduleKind kind) {
  return core::enum_name(kScheduleKinds, kind);
}

ScheduleKind parse_schedule_kind(const std::string& name) {
  return core::parse_enum(kScheduleKinds, name, "parallel.pp_schedule", "schedule");
}

void check_virtual_stages(ScheduleKind kind, int virtual_stages) {
  PARALLAX_CHECK(virtual_stages >= 1, ConfigError,
                 "key 'parallel.pp_virtual_stages': {} must be at least 1", virtual_stages);
  PARALLAX_CHECK(virtual_stages == 1 || kind == ScheduleKind::kInterleaved, ConfigError,
                 "keys 'parallel.pp_virtual_stages' and 'parallel.pp_schedule': {} virtual stages "
                 "per rank need pp_schedule=interleaved, not '{}'",
                 virtual_stages, to_string(kind));
}

Schedule build_schedule(const std::string& kind, int ranks, int micro_batches, int virtual_stages) {
  return build_schedule(parse_schedule_kind(kind), ranks, micro_batches, virtual_stages);
}

Schedule build_schedule(ScheduleKind kind, int ranks, int micro_batches, int virtual_stages) {
  PARALLAX_CHECK(ranks >= 2, ConfigError,
                 "key 'parallel.pp': a pipeline schedule needs at least 2 stages, got {}", ranks);
  PARALLAX_CHECK(micro_batches >= 1, ConfigError,
                 "key 'train.grad_accum': the pipeline needs at least one micro-batch, got {}",
                 micro_batches);
  check_virtual_stages(kind, virtual_stages);
  Schedule s;
  s.kind = kind;
  s.ranks = ranks;
  s.virtual_stages = virtual_stages;
  s.micro_batches = micro_batches;
  std::vector<Order> orders;
  std::vector<std::vector<bool>> joined(static_cast<std::size_t>(ranks));
  switch (kind) {
    case ScheduleKind::kGpipe:
      orders = gpipe_order(ranks, micro_batches);
      break;
    case ScheduleKind::k1F1B:
      orders = one_f_one_b_order(ranks, micro_batches);
      break;
    case ScheduleKind::kInterleaved:
      PARALLAX_CHECK(micro_batches % ranks == 0, ConfigError,
                     "keys 'train.grad_accum' and 'parallel.pp': the interleaved schedule runs the "
                     "micro-batches in groups of pp, so their number ({}) must be a multiple of pp "
                     "({}); use pp_schedule=1f1b for {} micro-batches",
                     micro_batches, ranks, micro_batches);
      orders = interleaved_order(ranks, micro_batches, virtual_stages, joined);
      break;
    case ScheduleKind::kZb:
      orders = zb_h1_order(ranks, micro_batches);
      // A W needs no message: the batch after it moves before it (the next op's receive is posted
      // before the W runs, and the previous B's send is not held back by it).
      for (int r = 0; r < ranks; ++r) {
        joined[r].assign(orders[r].size(), false);
        for (std::size_t j = 0; j + 1 < orders[r].size(); ++j)
          joined[r][j] = orders[r][j].kind == OpKind::kWeight;
      }
      break;
  }
  for (int r = 0; r < ranks; ++r) s.ops.push_back(with_comm(s, orders[r], joined[r]));
  return s;
}

}  // namespace parallax::parallel::pipeline
