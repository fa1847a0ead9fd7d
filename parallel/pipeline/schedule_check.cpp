#include "parallel/pipeline/schedule_check.h"

#include "core/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

namespace parallax::parallel::pipeline {

namespace {

// A message: (act or grad, micro, producing stage).
using MsgKey = std::tuple<int, int, int>;
MsgKey msg_key(const Op& op) {
  const int dir = op.kind == OpKind::kSendAct || op.kind == OpKind::kRecvAct ? 0 : 1;
  return {dir, op.micro, op.stage};
}

std::string where(const Schedule& s, int r, std::size_t i) {
  return fmt::format("pipeline plan '{}': rank {} op {} ({})", s.name(), r, i,
                     to_string(s.ops[r][i]));
}

// Each maximal run of consecutive communication ops of one rank's plan, as [first, end).
std::vector<std::pair<std::size_t, std::size_t>> comm_runs(const std::vector<Op>& ops) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  for (std::size_t i = 0; i < ops.size();) {
    if (!ops[i].is_comm()) {
      ++i;
      continue;
    }
    std::size_t end = i;
    while (end < ops.size() && ops[end].is_comm()) ++end;
    out.emplace_back(i, end);
    i = end;
  }
  return out;
}

// simulate_nccl()'s run: each rank's batches and how far its compute and communication streams
// got, where both ends of every message live, and which directions are connected.
class NcclSimulation {
 public:
  using Batch = std::pair<std::size_t, std::size_t>;

  NcclSimulation(const Schedule& s, NcclBatching batching, bool connect_up_front)
      : s_(s), p_(s.ranks), last_(s.stages() - 1), connect_up_front_(connect_up_front) {
    st_.resize(static_cast<std::size_t>(p_));
    const auto matched = batching == NcclBatching::kMatched
                             ? comm_batches(s)
                             : std::vector<std::vector<std::pair<std::size_t, std::size_t>>>();
    for (int r = 0; r < p_; ++r) {
      if (batching == NcclBatching::kMatched) {
        st_[r].batches = matched[r];
      } else if (batching == NcclBatching::kRuns) {
        st_[r].batches = comm_runs(s.ops[r]);
      } else {
        for (std::size_t i = 0; i < s.ops[r].size(); ++i)
          if (s.ops[r][i].is_comm()) st_[r].batches.emplace_back(i, i + 1);
      }
    }
    // Where each message's receive lives: (rank, op index), and its send.
    for (int r = 0; r < p_; ++r) {
      for (std::size_t i = 0; i < s.ops[r].size(); ++i) {
        const Op& op = s.ops[r][i];
        if (!op.is_comm()) continue;
        (op.is_send() ? send_at_ : recv_at_)[msg_key(op)] = {r, i};
      }
    }
    if (connect_up_front)
      for (int r = 0; r < p_; ++r)
        for (const auto& batch : st_[r].batches) connected_.merge(directions(r, batch));
  }

  // Runs every rank's streams to the end of the plan; throws naming what each rank waits for when
  // none can move.
  void run() {
    for (;;) {
      bool progress = connect();
      progress = run_compute() || progress;
      progress = move_batches() || progress;
      if (finished()) return;
      if (!progress) deadlock();
    }
  }

 private:
  struct RankState {
    std::vector<Batch> batches;
    std::size_t compute = 0;         // next op index whose compute is pending (scans the plan)
    std::size_t batch = 0;           // the running or next batch
    std::set<std::size_t> done_ops;  // comm ops completed
  };

  // The directions (from, to) a batch uses.
  std::set<std::pair<int, int>> directions(int r, Batch batch) const {
    std::set<std::pair<int, int>> out;
    for (std::size_t i = batch.first; i < batch.second; ++i) {
      const Op& op = s_.ops[r][i];
      out.insert(op.is_send() ? std::pair{r, op.peer} : std::pair{op.peer, r});
    }
    return out;
  }
  // All compute ops listed before op i have run.
  bool computed_before(int r, std::size_t i) const {
    std::size_t c = st_[r].compute;
    while (c < i && s_.ops[r][c].is_comm()) ++c;
    return c >= i;
  }
  // A batch is posted once the compute before it has run and, under lazy connection, every
  // direction it uses is connected: ncclGroupEnd sets up a missing direction with the peer, which
  // must be inside a group that uses the same direction at the same time.
  bool ready(int r) const {
    const RankState& rs = st_[r];
    return rs.batch < rs.batches.size() && computed_before(r, rs.batches[rs.batch].first);
  }
  bool posted(int r) const {
    if (!ready(r)) return false;
    for (const auto& d : directions(r, st_[r].batches[st_[r].batch]))
      if (!connected_.count(d)) return false;
    return true;
  }
  bool running(int r, std::size_t op_index) const {
    const RankState& rs = st_[r];
    if (!posted(r)) return false;
    const auto [b, e] = rs.batches[rs.batch];
    return op_index >= b && op_index < e;
  }
  // NCCL's lazy connection: a direction two ready batches both use gets connected.
  bool connect() {
    bool progress = false;
    for (int r = 0; r < p_; ++r) {
      if (!ready(r)) continue;
      for (const auto& d : directions(r, st_[r].batches[st_[r].batch])) {
        const int peer = d.first == r ? d.second : d.first;
        if (connected_.count(d) || !ready(peer) ||
            !directions(peer, st_[peer].batches[st_[peer].batch]).count(d))
          continue;
        connected_.insert(d);
        progress = true;
      }
    }
    return progress;
  }
  // The compute streams: each runs while its inputs have arrived.
  bool run_compute() {
    bool progress = false;
    for (int r = 0; r < p_; ++r) {
      RankState& rs = st_[r];
      while (rs.compute < s_.ops[r].size()) {
        const Op& op = s_.ops[r][rs.compute];
        if (op.is_comm()) {
          ++rs.compute;
          continue;
        }
        MsgKey need{-1, 0, 0};
        if (op.kind == OpKind::kForward && op.stage > 0) need = {0, op.micro, op.stage - 1};
        if (op.kind == OpKind::kBackward && op.stage < last_) need = {1, op.micro, op.stage + 1};
        if (std::get<0>(need) >= 0) {
          const auto it = recv_at_.find(need);
          if (it == recv_at_.end() || !rs.done_ops.count(it->second.second)) break;
        }
        ++rs.compute;
        progress = true;
      }
    }
    return progress;
  }
  // The communication streams. One batch is one NCCL group, whose sends and receives run in one
  // kernel and may wait on each other (NVIDIA/nccl#1279: a group's calls are not guaranteed to
  // progress apart), so a batch moves only as a whole: the posted batches whose every message
  // has its other end in a posted batch that moves as well complete together.
  bool move_batches() {
    std::vector<char> moves(static_cast<std::size_t>(p_));
    for (int r = 0; r < p_; ++r) moves[r] = posted(r);
    for (bool dropped = true; dropped;) {
      dropped = false;
      for (int r = 0; r < p_; ++r) {
        if (!moves[r]) continue;
        const auto [b, e] = st_[r].batches[st_[r].batch];
        for (std::size_t i = b; i < e && moves[r]; ++i) {
          const Op& op = s_.ops[r][i];
          const auto& other = op.is_send() ? recv_at_ : send_at_;
          const auto it = other.find(msg_key(op));
          if (it == other.end() || !moves[it->second.first] ||
              !running(it->second.first, it->second.second)) {
            moves[r] = 0;
            dropped = true;
          }
        }
      }
    }
    bool progress = false;
    for (int r = 0; r < p_; ++r) {
      if (!moves[r]) continue;
      const auto [b, e] = st_[r].batches[st_[r].batch];
      for (std::size_t i = b; i < e; ++i) st_[r].done_ops.insert(i);
      ++st_[r].batch;
      progress = true;
    }
    return progress;
  }
  bool finished() const {
    for (int r = 0; r < p_; ++r)
      if (st_[r].compute < s_.ops[r].size() || st_[r].batch < st_[r].batches.size()) return false;
    return true;
  }
  [[noreturn]] void deadlock() const {
    std::string stuck;
    for (int r = 0; r < p_; ++r) {
      const RankState& rs = st_[r];
      if (rs.batch < rs.batches.size()) {
        const auto [b, e] = rs.batches[rs.batch];
        std::string ops;
        for (std::size_t i = b; i < e; ++i)
          if (!rs.done_ops.count(i))
            ops += fmt::format("{}{}", ops.empty() ? "" : ", ", to_string(s_.ops[r][i]));
        std::string unconnected;
        if (ready(r))
          for (const auto& d : directions(r, rs.batches[rs.batch]))
            if (!connected_.count(d))
              unconnected += fmt::format("{}rank {} -> rank {}", unconnected.empty() ? "" : ", ",
                                         d.first, d.second);
        stuck += unconnected.empty()
                     ? fmt::format("; rank {}'s batch at op {} waits in [{}]", r, b, ops)
                     : fmt::format(
                           "; rank {}'s batch at op {} ([{}]) cannot be posted: it waits to "
                           "connect {}",
                           r, b, ops, unconnected);
      }
      if (rs.compute < s_.ops[r].size())
        stuck += fmt::format("; rank {} op {} ({}) waits for its input", r, rs.compute,
                             to_string(s_.ops[r][rs.compute]));
    }
    throw_error<Error>(
        "pipeline plan '{}' (pp {}, {} micro-batches) deadlocks under NCCL's rule (batches in "
        "order on one stream, no buffering{}){}",
        s_.name(), s_.ranks, s_.micro_batches,
        connect_up_front_ ? "" : ", each direction connected by the first batch that uses it",
        stuck);
  }

  const Schedule& s_;
  const int p_, last_;
  const bool connect_up_front_;
  std::vector<RankState> st_;
  std::map<MsgKey, std::pair<int, std::size_t>> send_at_, recv_at_;
  std::set<std::pair<int, int>> connected_;
};

}  // namespace

void check(const Schedule& s) {
  const int S = s.stages(), last = S - 1;
  PARALLAX_CHECK(static_cast<int>(s.ops.size()) == s.ranks, Error,
                 "pipeline plan '{}': {} rank lists for {} ranks", s.name(), s.ops.size(), s.ranks);
  // 1. Each compute op on its stage's rank, once; its inputs earlier on the same rank.
  std::map<std::tuple<int, int, int>, std::pair<int, std::size_t>> seen;  // (kind, m, s) -> where
  std::map<MsgKey, std::pair<int, std::size_t>> sends, recvs;
  for (int r = 0; r < s.ranks; ++r) {
    std::set<std::tuple<int, int, int>> done;  // (kind, micro, stage) already on this rank
    const auto has = [&](OpKind k, int m, int st) {
      return done.count({static_cast<int>(k), m, st}) != 0;
    };
    for (std::size_t i = 0; i < s.ops[r].size(); ++i) {
      const Op& op = s.ops[r][i];
      PARALLAX_CHECK(op.micro >= 0 && op.micro < s.micro_batches && op.stage >= 0 && op.stage < S,
                     Error, "{}: micro-batch or stage out of range ({} micro-batches, {} stages)",
                     where(s, r, i), s.micro_batches, S);
      if (op.is_comm()) {
        const bool act = op.kind == OpKind::kSendAct || op.kind == OpKind::kRecvAct;
        // The producing stage and the consuming one.
        const int from = op.stage, to = act ? op.stage + 1 : op.stage - 1;
        PARALLAX_CHECK(to >= 0 && to <= last, Error, "{}: stage {} has no {} neighbour",
                       where(s, r, i), from, act ? "next" : "previous");
        const int self = op.is_send() ? from : to, other = op.is_send() ? to : from;
        PARALLAX_CHECK(s.rank_of(self) == r && s.rank_of(other) == op.peer, Error,
                       "{}: the message goes from stage {} (rank {}) to stage {} (rank {})",
                       where(s, r, i), from, s.rank_of(from), to, s.rank_of(to));
        if (op.is_send()) {
          PARALLAX_CHECK(has(act ? OpKind::kForward : OpKind::kBackward, op.micro, op.stage), Error,
                         "{}: sent before its {} ran on this rank", where(s, r, i),
                         act ? "forward" : "backward");
        }
        auto& book = op.is_send() ? sends : recvs;
        const auto [it, fresh] = book.emplace(msg_key(op), std::make_pair(r, i));
        PARALLAX_CHECK(fresh, Error, "{}: the same message is {} twice (first as rank {} op {})",
                       where(s, r, i), op.is_send() ? "sent" : "received", it->second.first,
                       it->second.second);
        done.insert({static_cast<int>(op.kind), op.micro, op.stage});
        continue;
      }
      PARALLAX_CHECK(s.rank_of(op.stage) == r, Error, "{}: stage {} lives on rank {}",
                     where(s, r, i), op.stage, s.rank_of(op.stage));
      PARALLAX_CHECK(op.kind != OpKind::kWeight || s.split_backward(), Error,
                     "{}: a W pass in a schedule without a split backward", where(s, r, i));
      const auto [it, fresh] = seen.emplace(
          std::make_tuple(static_cast<int>(op.kind), op.micro, op.stage), std::make_pair(r, i));
      PARALLAX_CHECK(fresh, Error, "{}: runs twice (first as rank {} op {})", where(s, r, i),
                     it->second.first, it->second.second);
      if (op.kind == OpKind::kForward) {
        PARALLAX_CHECK(op.stage == 0 || has(OpKind::kRecvAct, op.micro, op.stage - 1), Error,
                       "{}: no earlier receive of its input from stage {} on rank {}",
                       where(s, r, i), op.stage - 1, s.rank_of(op.stage - 1));
      } else if (op.kind == OpKind::kBackward) {
        PARALLAX_CHECK(has(OpKind::kForward, op.micro, op.stage), Error,
                       "{}: runs before its forward", where(s, r, i));
        PARALLAX_CHECK(op.stage == last || has(OpKind::kRecvGrad, op.micro, op.stage + 1), Error,
                       "{}: no earlier receive of its output gradient from stage {} on rank {}",
                       where(s, r, i), op.stage + 1, s.rank_of(op.stage + 1));
      } else {
        PARALLAX_CHECK(has(OpKind::kBackward, op.micro, op.stage), Error,
                       "{}: runs before its input-gradient pass B", where(s, r, i));
      }
      done.insert({static_cast<int>(op.kind), op.micro, op.stage});
    }
  }
  // 2. Every (micro-batch, stage) computed once per pass.
  for (int m = 0; m < s.micro_batches; ++m) {
    for (int st = 0; st < S; ++st) {
      for (OpKind k : {OpKind::kForward, OpKind::kBackward, OpKind::kWeight}) {
        if (k == OpKind::kWeight && !s.split_backward()) continue;
        PARALLAX_CHECK(seen.count({static_cast<int>(k), m, st}) != 0, Error,
                       "pipeline plan '{}': rank {} never runs {}", s.name(), s.rank_of(st),
                       to_string(Op{k, m, st, -1}));
      }
    }
  }
  // 3. Sends and receives pair up.
  for (const auto& [key, at] : recvs) {
    PARALLAX_CHECK(sends.count(key) != 0, Error, "{} has no matching send on rank {}",
                   where(s, at.first, at.second), s.ops[at.first][at.second].peer);
  }
  for (const auto& [key, at] : sends) {
    PARALLAX_CHECK(recvs.count(key) != 0, Error, "{} has no matching receive on rank {}",
                   where(s, at.first, at.second), s.ops[at.first][at.second].peer);
  }
  // 4. No rank waits forever under independent progress, nor under NCCL's rule (the simulations
  // throw naming the stuck ops).
  simulate(s, 1, 2, 1);
  simulate_nccl(s);
}

std::vector<std::vector<std::pair<std::size_t, std::size_t>>> comm_batches(const Schedule& s) {
  const int p = s.ranks;
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> batches(
      static_cast<std::size_t>(p));
  // Where each op's other end lives: (peer rank, op index).
  std::map<MsgKey, std::pair<int, std::size_t>> send_at, recv_at;
  for (int r = 0; r < p; ++r) {
    batches[r] = comm_runs(s.ops[r]);
    for (std::size_t i = 0; i < s.ops[r].size(); ++i) {
      const Op& op = s.ops[r][i];
      if (op.is_comm()) (op.is_send() ? send_at : recv_at)[msg_key(op)] = {r, i};
    }
  }
  const auto other_end = [&](const Op& op) -> std::pair<int, std::size_t> {
    const auto& book = op.is_send() ? recv_at : send_at;
    const auto it = book.find(msg_key(op));
    return it == book.end() ? std::pair<int, std::size_t>{-1, 0} : it->second;
  };
  // Refines until every batch's messages with one peer are all in one batch of that peer: a
  // batch splits where its next op's other end lies in another of the peer's batches than an
  // earlier op with that peer. Only splits, so it ends.
  for (bool changed = true; changed;) {
    changed = false;
    std::vector<std::map<std::size_t, std::size_t>> batch_of(static_cast<std::size_t>(p));
    for (int r = 0; r < p; ++r)
      for (std::size_t k = 0; k < batches[r].size(); ++k)
        for (std::size_t i = batches[r][k].first; i < batches[r][k].second; ++i) batch_of[r][i] = k;
    for (int r = 0; r < p; ++r) {
      std::vector<std::pair<std::size_t, std::size_t>> refined;
      for (const auto& [b, e] : batches[r]) {
        std::size_t start = b;
        std::map<int, std::size_t> seen;  // peer -> the peer's batch of this segment's messages
        for (std::size_t i = b; i < e; ++i) {
          const auto [peer, j] = other_end(s.ops[r][i]);
          if (peer < 0) continue;
          const std::size_t theirs = batch_of[peer].at(j);
          const auto it = seen.find(peer);
          if (it != seen.end() && it->second != theirs) {
            refined.emplace_back(start, i);
            start = i;
            seen.clear();
            changed = true;
          }
          seen[peer] = theirs;
        }
        refined.emplace_back(start, e);
      }
      batches[r] = std::move(refined);
    }
  }
  return batches;
}

std::vector<std::pair<std::size_t, std::size_t>> comm_batches(const Schedule& s, int rank) {
  return comm_batches(s).at(static_cast<std::size_t>(rank));
}

void check_posting_order(const Schedule& s) {
  // Per ordered pair (from, to): the messages in the order the sender posts them, and in the order
  // the receiver posts their receives.
  using Msg = std::tuple<int, int, int>;
  std::map<std::pair<int, int>, std::vector<std::pair<Msg, int>>> sent, received;
  for (int r = 0; r < s.ranks; ++r) {
    const auto& ops = s.ops[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const Op& op = ops[i];
      if (!op.is_comm()) continue;
      const Msg m{op.kind == OpKind::kSendGrad || op.kind == OpKind::kRecvGrad ? 1 : 0, op.micro,
                  op.stage};
      if (op.is_send()) {
        sent[{r, op.peer}].push_back({m, static_cast<int>(i)});
      } else {
        received[{op.peer, r}].push_back({m, static_cast<int>(i)});
      }
    }
  }
  const auto name = [](const Msg& m) {
    return fmt::format("the {} of micro-batch {} from stage {}",
                       std::get<0>(m) ? "gradient" : "activations", std::get<1>(m), std::get<2>(m));
  };
  for (const auto& [pair, out] : sent) {
    const auto& in = received[pair];
    PARALLAX_CHECK(in.size() == out.size(), Error,
                   "pipeline plan '{}': rank {} sends {} messages to rank {}, which receives {}",
                   s.name(), pair.first, out.size(), pair.second, in.size());
    for (std::size_t k = 0; k < out.size(); ++k) {
      if (in[k].first == out[k].first) continue;
      throw_error<Error>(
          "pipeline plan '{}' (pp {}, {} micro-batches, {} virtual stages): rank {} posts its "
          "receive of {} (op {}) as message #{} from rank {}, but rank {} posts {} (op {}) as its "
          "#{}: on a transport that matches messages by order (NCCL) they would be swapped",
          s.name(), s.ranks, s.micro_batches, s.virtual_stages, pair.second, name(in[k].first),
          in[k].second, k + 1, pair.first, pair.first, name(out[k].first), out[k].second, k + 1);
    }
  }
}

void simulate_nccl(const Schedule& s, NcclBatching batching, bool connect_up_front) {
  NcclSimulation(s, batching, connect_up_front).run();
}

std::vector<int> in_flight_per_stage(const Schedule& s) {
  std::vector<int> live(static_cast<std::size_t>(s.stages()), 0), most = live;
  for (const auto& ops : s.ops) {
    for (const Op& op : ops) {
      const auto st = static_cast<std::size_t>(op.stage);
      if (op.kind == OpKind::kForward) most[st] = std::max(most[st], ++live[st]);
      if (op.kind == (s.split_backward() ? OpKind::kWeight : OpKind::kBackward)) --live[st];
    }
  }
  return most;
}

Timeline simulate(const Schedule& s, double fc, double bc, double wc) {
  if (s.split_backward() && wc == 0) {
    wc = bc / 2;
    bc = bc / 2;
  }
  const int p = s.ranks, last = s.stages() - 1;
  std::vector<std::size_t> idx(static_cast<std::size_t>(p), 0);
  std::vector<double> clock(static_cast<std::size_t>(p), 0);
  std::map<MsgKey, double> send_post;  // message -> when its send was posted
  Timeline t;
  // The message a compute op waits for (dir < 0: none).
  const auto needs = [&](const Op& op) -> MsgKey {
    if (op.kind == OpKind::kForward && op.stage > 0) return {0, op.micro, op.stage - 1};
    if (op.kind == OpKind::kBackward && op.stage < last) return {1, op.micro, op.stage + 1};
    return {-1, 0, 0};
  };
  for (;;) {
    bool progress = false, finished = true;
    for (int r = 0; r < p; ++r) {
      while (idx[r] < s.ops[r].size()) {
        const Op& op = s.ops[r][idx[r]];
        if (op.is_comm()) {
          // Posting never blocks: a send is buffered, a receive waits where its data is used.
          if (op.is_send()) send_post[msg_key(op)] = clock[r];
          ++idx[r];
          progress = true;
          continue;
        }
        double start = clock[r];
        const MsgKey need = needs(op);
        if (std::get<0>(need) >= 0) {
          const auto it = send_post.find(need);
          if (it == send_post.end()) break;  // waits for a neighbour
          start = std::max(start, it->second);
        }
        const double cost = op.kind == OpKind::kForward    ? fc
                            : op.kind == OpKind::kBackward ? bc
                                                           : wc;
        t.slots.push_back({r, op, start, start + cost});
        clock[r] = start + cost;
        ++idx[r];
        progress = true;
      }
      if (idx[r] < s.ops[r].size()) finished = false;
    }
    if (finished) break;
    if (!progress) {
      std::string stuck;
      for (int r = 0; r < p; ++r) {
        if (idx[r] >= s.ops[r].size()) continue;
        const Op& op = s.ops[r][idx[r]];
        stuck +=
            fmt::format("; rank {} op {} ({}) waits for the {} of stage {}", r, idx[r],
                        to_string(op), op.kind == OpKind::kForward ? "activations" : "gradient",
                        op.kind == OpKind::kForward ? op.stage - 1 : op.stage + 1);
      }
      throw_error<Error>("pipeline plan '{}' deadlocks{}", s.name(), stuck);
    }
  }
  for (double c : clock) t.makespan = std::max(t.makespan, c);
  double busy0 = 0;
  for (const auto& slot : t.slots)
    if (slot.rank == 0) busy0 += slot.end - slot.start;
  t.busy_per_rank = busy0;
  return t;
}

double formula_bubble(const Schedule& s) {
  const double p = s.ranks, m = s.micro_batches, v = s.virtual_stages;
  if (s.kind == ScheduleKind::kInterleaved) return (p - 1) / (m * v);
  if (s.kind == ScheduleKind::kZb) return (p - 1) / (3 * m);
  return (p - 1) / m;
}

std::string render(const Schedule& s) {
  const Timeline t = simulate(s);
  const int cols = static_cast<int>(std::ceil(t.makespan));
  std::vector<std::vector<std::string>> grid(static_cast<std::size_t>(s.ranks),
                                             std::vector<std::string>(cols, "."));
  for (const auto& slot : t.slots) {
    std::string cell = fmt::format("{}{}", to_string(slot.op.kind), slot.op.micro);
    if (s.virtual_stages > 1) cell += fmt::format(".c{}", s.chunk_of(slot.op.stage));
    for (int c = static_cast<int>(std::lround(slot.start)); c < std::lround(slot.end); ++c)
      grid[slot.rank][c] = c == std::lround(slot.start) ? cell : "-";
  }
  std::size_t width = 1;
  for (const auto& row : grid)
    for (const auto& cell : row) width = std::max(width, cell.size());
  std::string out = fmt::format(
      "pipeline schedule '{}': pp={}, {} micro-batches{}; F = 1, B = {} time units{}\n", s.name(),
      s.ranks, s.micro_batches,
      s.virtual_stages > 1 ? fmt::format(", {} virtual stages per rank", s.virtual_stages) : "",
      s.split_backward() ? "1, W = 1" : "2", "; '.' idle, '-' the op goes on");
  for (int r = 0; r < s.ranks; ++r) {
    out += fmt::format("rank {:>2} |", r);
    for (const auto& cell : grid[r]) out += fmt::format(" {:<{}}", cell, width);
    out += "\n";
  }
  out += fmt::format("bubble (idle / compute per rank): {:.3f}; formula {:.3f}\n", t.bubble(),
                     formula_bubble(s));
  return out;
}

}  // namespace parallax::parallel::pipeline
