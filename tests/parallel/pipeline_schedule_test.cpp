// Pipeline schedules as global plans (parallel/pipeline/schedule.h, schedule_check.h): every
// schedule passes its check over a grid of (pp, micro-batches, virtual stages); broken plans (a
// missing receive, a send to the wrong rank, an order that deadlocks, a missing backward) are
// caught before any step and named; the simulated bubble equals its formula where the formula is
// exact; the partition.
#include "parallel/pipeline/partition.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/pipeline/schedule_check.h"
#include "parallel/plan.h"

#include "core/error.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

using namespace parallax;
namespace pl = parallax::parallel::pipeline;
namespace par = parallax::parallel;

namespace {

std::string error_of(const pl::Schedule& s) {
  try {
    pl::check(s);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// Every plan passes check() (independent progress and NCCL's batches on one stream) and
// check_posting_order(): NCCL matches point-to-point messages by order, so both ends of every pair
// post its messages in the same order (the engine posts each where the plan lists it).
TEST(PipelineSchedule, EveryScheduleChecksOverAGridOfShapes) {
  const auto both = [](const pl::Schedule& s, const std::string& what) {
    EXPECT_NO_THROW(pl::check(s)) << what;
    EXPECT_NO_THROW(pl::check_posting_order(s)) << what << " (order)";
  };
  for (const char* kind : {"gpipe", "1f1b", "zb"}) {
    for (int p : {2, 3, 4, 8}) {
      for (int m : {1, 2, 3, 4, 5, 8, 16}) {
        both(pl::build_schedule(kind, p, m), fmt::format("{} pp={} m={}", kind, p, m));
      }
    }
  }
  for (int p : {2, 3, 4}) {
    for (int v : {1, 2, 3}) {
      for (int k : {1, 2, 3}) {
        both(pl::build_schedule("interleaved", p, k * p, v),
             fmt::format("interleaved pp={} m={} v={}", p, k * p, v));
      }
    }
  }
}

TEST(PipelineSchedule, APostingOrderThatDiffersFromTheSendOrderIsNamed) {
  // 1f1b over 2 ranks, 2 micro-batches; rank 1's two forwards swapped (with their receives, so the
  // plan still passes check(): only the order of its receives differs from rank 0's sends).
  pl::Schedule s = pl::build_schedule("1f1b", 2, 2);
  auto& ops = s.ops[1];
  std::vector<std::size_t> fwd;
  for (std::size_t i = 0; i < ops.size(); ++i)
    if (ops[i].kind == pl::OpKind::kForward || ops[i].kind == pl::OpKind::kRecvAct)
      fwd.push_back(i);
  // Relabel micro-batches 0 <-> 1 on rank 1's receives and forwards.
  for (std::size_t i : fwd) ops[i].micro = 1 - ops[i].micro;
  try {
    pl::check_posting_order(s);
    FAIL() << "expected an error";
  } catch (const parallax::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(
        what.find("rank 1 posts its receive of the activations of micro-batch 1 from stage 0"),
        std::string::npos)
        << what;
    EXPECT_NE(
        what.find("rank 0 posts the activations of micro-batch 0 from stage 0 (op 1) as its #1"),
        std::string::npos)
        << what;
  }
}

// The hang of separate send()/recv() calls on NCCL (issue: bev/large pp 2 1f1b hung at batch 8 x
// 4): in 1F1B's steady state both neighbours send before they receive, and NCCL does not buffer a
// large message, so each send waits for a receive its peer posts after its own send. The plan's
// batches (each slot's sends and receives in one call) run; the same plan with one call per
// message deadlocks under NCCL's rule, and the error names both ranks' stuck calls.
TEST(PipelineSchedule, BatchingEachSlotIsWhatKeeps1F1BFromDeadlockingOnNccl) {
  for (const char* kind : {"1f1b", "zb"}) {
    for (int p : {2, 4}) {
      const pl::Schedule s = pl::build_schedule(kind, p, 8);
      EXPECT_NO_THROW(pl::simulate_nccl(s)) << kind << " pp " << p;
      try {
        pl::simulate_nccl(s, pl::NcclBatching::kPerMessage);
        ADD_FAILURE() << kind << " pp " << p << ": expected a deadlock with one call per message";
      } catch (const parallax::Error& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("deadlocks under NCCL's rule"), std::string::npos) << what;
        EXPECT_NE(what.find("rank 0's batch"), std::string::npos) << what;
        EXPECT_NE(what.find("rank 1's batch"), std::string::npos) << what;
      }
    }
  }
  // GPipe runs every forward before any backward: no exchange in both directions at once, so one
  // call per message runs.
  const pl::Schedule g = pl::build_schedule("gpipe", 4, 8);
  EXPECT_NO_THROW(pl::simulate_nccl(g, pl::NcclBatching::kPerMessage));
  EXPECT_NO_THROW(pl::simulate_nccl(g));
}

// GPipe on 2 x H200 (2026-11-29, bev and vit at pp 2) hung twice, and the model reproduces both
// while 1f1b, zb and interleaved, which ran there, pass it:
// 1. Posting each run of communication ops as one group, stage 0's "send act m3 + recv grad m0"
//    first waited in ncclGroupEnd to connect 1 -> 0 ("timed out ... (while enqueueing)"): NCCL
//    connects a direction lazily, in the first group that uses it, with the peer inside a group
//    using it too, and stage 1 sends only after m3 arrives.
// 2. With every direction connected up front, that group was posted and still never finished: a
//    group moves as a whole, and its gradient receive waits for stage 1.
// Cutting the runs where they pair with different batches of the peer (comm_batches) runs every
// plan under both rules.
TEST(PipelineSchedule, GpipeNeedsItsRunsCutIntoMatchedBatchesOnNccl) {
  const auto deadlocks = [](const pl::Schedule& s, pl::NcclBatching batching, bool up_front,
                            const std::string& expect) {
    try {
      pl::simulate_nccl(s, batching, up_front);
      ADD_FAILURE() << s.name() << " pp " << s.ranks << " m " << s.micro_batches
                    << ": expected a deadlock";
    } catch (const parallax::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("deadlocks under NCCL's rule"), std::string::npos) << what;
      EXPECT_NE(what.find(expect), std::string::npos) << what;
    }
  };
  for (int p : {2, 4}) {
    for (int m : {4, 8}) {
      const pl::Schedule g = pl::build_schedule("gpipe", p, m);
      deadlocks(g, pl::NcclBatching::kRuns, false,
                "cannot be posted: it waits to connect rank 1 -> rank 0");
      deadlocks(g, pl::NcclBatching::kRuns, true,
                fmt::format("rank 0's batch at op {} waits in [send act m{} s0 -> r1, recv grad",
                            2 * m - 1, m - 1));
      EXPECT_NO_THROW(pl::simulate_nccl(g, pl::NcclBatching::kMatched, true));
      EXPECT_NO_THROW(pl::simulate_nccl(g, pl::NcclBatching::kMatched, false));
      // Only the run that holds both directions is cut.
      const auto runs = pl::comm_batches(g, 0);
      EXPECT_EQ(runs.size(), static_cast<std::size_t>(2 * m)) << "gpipe pp " << p << " m " << m;
    }
  }
  for (const char* kind : {"1f1b", "zb"}) {
    for (int p : {2, 4}) {
      for (int m : {4, 8}) {
        const pl::Schedule s = pl::build_schedule(kind, p, m);
        for (auto batching : {pl::NcclBatching::kRuns, pl::NcclBatching::kMatched})
          for (bool up_front : {false, true})
            EXPECT_NO_THROW(pl::simulate_nccl(s, batching, up_front)) << kind << " pp " << p;
        // send_forward_recv_backward stays one group: 1F1B's batches are its runs.
        std::vector<std::vector<std::pair<std::size_t, std::size_t>>> runs;
        for (int r = 0; r < p; ++r) {
          runs.emplace_back();
          for (std::size_t i = 0; i < s.ops[r].size(); ++i) {
            if (!s.ops[r][i].is_comm()) continue;
            if (i > 0 && s.ops[r][i - 1].is_comm())
              runs.back().back().second = i + 1;
            else
              runs.back().emplace_back(i, i + 1);
          }
        }
        EXPECT_EQ(pl::comm_batches(s), runs) << kind << " pp " << p << " m " << m;
      }
    }
  }
  for (bool up_front : {false, true})
    EXPECT_NO_THROW(pl::simulate_nccl(pl::build_schedule("interleaved", 2, 4, 2),
                                      pl::NcclBatching::kRuns, up_front));
}

TEST(PipelineSchedule, BubbleMatchesTheFormula) {
  // Uniform stages, F = 1, B = 2: 1F1B and GPipe idle (p - 1)(F + B) per rank over m (F + B) of
  // work; interleaving divides it by v (Narayanan et al. 2021). Exact in the simulation.
  for (int p : {2, 4, 8}) {
    for (int m : {4, 8, 16}) {
      for (const char* kind : {"gpipe", "1f1b"}) {
        const pl::Schedule s = pl::build_schedule(kind, p, m);
        EXPECT_NEAR(pl::simulate(s).bubble(), pl::formula_bubble(s), 1e-12)
            << kind << " pp=" << p << " m=" << m;
      }
      if (m % p == 0) {
        for (int v : {2, 4}) {
          const pl::Schedule s = pl::build_schedule("interleaved", p, m, v);
          EXPECT_NEAR(pl::simulate(s).bubble(), pl::formula_bubble(s), 1e-12)
              << "interleaved pp=" << p << " m=" << m << " v=" << v;
        }
      }
      // ZB-H1 (F = B = W = 1): the paper's (p - 1) / (3 m) once m >= p (a third of 1F1B's);
      // below, at most 1F1B's. Every rank holds at most pp micro-batches between their F and W
      // (the first rank's 1F1B bound).
      const pl::Schedule zb = pl::build_schedule("zb", p, m);
      const double b = pl::simulate(zb).bubble();
      if (m >= p) {
        EXPECT_NEAR(b, pl::formula_bubble(zb), 1e-12) << "pp=" << p << " m=" << m;
      } else {
        EXPECT_LE(b, pl::formula_bubble(pl::build_schedule("1f1b", p, m)) + 1e-12);
        EXPECT_GE(b, pl::formula_bubble(zb) - 1e-12) << "pp=" << p << " m=" << m;
      }
      for (int r = 0; r < p; ++r) {
        int live = 0, most = 0;
        for (const pl::Op& op : zb.ops[r]) {
          live += op.kind == pl::OpKind::kForward ? 1 : op.kind == pl::OpKind::kWeight ? -1 : 0;
          most = std::max(most, live);
        }
        EXPECT_LE(most, p) << "zb pp=" << p << " m=" << m << " rank " << r;
      }
    }
  }
}

TEST(PipelineSchedule, AMissingReceiveIsCaughtBeforeTheFirstStep) {
  pl::Schedule s = pl::build_schedule("1f1b", 4, 8);
  auto& ops = s.ops[2];
  const auto it = std::find_if(ops.begin(), ops.end(), [](const pl::Op& op) {
    return op.kind == pl::OpKind::kRecvAct && op.micro == 3;
  });
  ASSERT_NE(it, ops.end());
  ops.erase(it);
  const std::string e = error_of(s);
  EXPECT_NE(e.find("rank 2"), std::string::npos) << e;
  EXPECT_NE(e.find("F3s2"), std::string::npos) << e;
  EXPECT_NE(e.find("receive"), std::string::npos) << e;
}

TEST(PipelineSchedule, AnUnmatchedSendAndAWrongPeerAreNamed) {
  {
    pl::Schedule s = pl::build_schedule("gpipe", 2, 2);
    // Rank 1 receives micro-batch 1's activations under micro-batch 0's name twice.
    for (auto& op : s.ops[1])
      if (op.kind == pl::OpKind::kRecvAct && op.micro == 1) op.micro = 0;
    EXPECT_NE(error_of(s).find("received twice"), std::string::npos) << error_of(s);
  }
  {
    pl::Schedule s = pl::build_schedule("1f1b", 3, 3);
    for (auto& op : s.ops[0])
      if (op.kind == pl::OpKind::kSendAct) op.peer = 2;
    EXPECT_NE(error_of(s).find("goes from stage 0 (rank 0) to stage 1 (rank 1)"), std::string::npos)
        << error_of(s);
  }
}

TEST(PipelineSchedule, AnOrderThatDeadlocksIsCaught) {
  // Rank 0 waits for micro-batch 0's gradient before sending micro-batch 1's activations, which
  // rank 1 needs before it can run... its forward of micro-batch 1, ahead of the backward of 0 in
  // GPipe: a cycle.
  pl::Schedule s = pl::build_schedule("gpipe", 2, 2);
  auto& r0 = s.ops[0];
  // Move rank 0's B0 (with its receive) right after F0's send, before F1.
  std::vector<pl::Op> reordered;
  std::vector<pl::Op> b0;
  for (const auto& op : r0) {
    if (op.micro == 0 && (op.kind == pl::OpKind::kRecvGrad || op.kind == pl::OpKind::kBackward))
      b0.push_back(op);
  }
  for (const auto& op : r0) {
    if (op.micro == 0 && (op.kind == pl::OpKind::kRecvGrad || op.kind == pl::OpKind::kBackward))
      continue;
    reordered.push_back(op);
    if (op.kind == pl::OpKind::kSendAct && op.micro == 0)
      reordered.insert(reordered.end(), b0.begin(), b0.end());
  }
  r0 = reordered;
  const std::string e = error_of(s);
  EXPECT_NE(e.find("deadlocks"), std::string::npos) << e;
  EXPECT_NE(e.find("rank 0"), std::string::npos) << e;
}

TEST(PipelineSchedule, AMissingBackwardIsNamed) {
  pl::Schedule s = pl::build_schedule("1f1b", 2, 4);
  auto& ops = s.ops[1];
  ops.erase(std::find_if(ops.begin(), ops.end(), [](const pl::Op& op) {
    return op.kind == pl::OpKind::kBackward && op.micro == 2;
  }));
  const std::string e = error_of(s);
  EXPECT_FALSE(e.empty());
  EXPECT_NE(e.find("rank 1"), std::string::npos) << e;
}

TEST(PipelineSchedule, ImpossibleSettingsAreConfigErrors) {
  EXPECT_THROW(pl::build_schedule("interleaved", 4, 6, 2), ConfigError);  // 6 % 4
  EXPECT_THROW(pl::build_schedule("1f1b", 2, 4, 2), ConfigError);         // v without interleaved
  EXPECT_THROW(pl::build_schedule("bogus", 2, 4), ConfigError);
  EXPECT_THROW(pl::build_schedule("1f1b", 1, 4), ConfigError);
  try {
    pl::build_schedule("interleaved", 4, 6, 2);
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("(6)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("(4)"), std::string::npos) << e.what();
  }
}

TEST(PipelineSchedule, RenderShowsEveryRankAndTheBubble) {
  const std::string t = pl::render(pl::build_schedule("1f1b", 4, 8));
  for (const char* s : {"rank  0", "rank  3", "F0", "B7", "bubble", "formula 0.375"})
    EXPECT_NE(t.find(s), std::string::npos) << s << "\n" << t;
}

TEST(PipelinePartition, BalancedExplicitAndRefused) {
  // Costs 1 2 3 4 5 6 over 3 stages: [1 2 3 4] [5] [6] has max 10; [1 2 3] [4 5] [6] max 9.
  EXPECT_EQ(pl::partition({1, 2, 3, 4, 5, 6}, 3), (std::vector<int>{0, 3, 5, 6}));
  EXPECT_EQ(pl::partition({1, 1, 1, 1}, 2), (std::vector<int>{0, 2, 4}));
  EXPECT_EQ(pl::partition({1, 1, 1, 1}, 2, {1, 3}), (std::vector<int>{0, 1, 4}));
  EXPECT_THROW(pl::partition({1, 1}, 3), ConfigError);
  EXPECT_THROW(pl::partition({1, 1, 1}, 2, {1, 1}), ConfigError);
  EXPECT_THROW(pl::partition({1, 1, 1}, 2, {3, 0}), ConfigError);
}

TEST(PipelinePartition, AmongTheFastestSplitsTheSmallestActivationPeak) {
  // Costs 6 1 1 1 1 over 3 stages: every split with [6] alone has the optimum's largest cost 6.
  // Under 1F1B (pp 3: stages hold 3, 2, 1 micro-batches) the heavy unit 1 (5 bytes) goes alone on
  // stage 1: max(2 x 5, 1 x 3) = 10 (against [5 1][1 1]: 12, [5 1 1][1]: 14).
  const std::vector<int> f1b = pl::in_flight_per_stage(pl::build_schedule("1f1b", 3, 6));
  EXPECT_EQ(f1b, (std::vector<int>{3, 2, 1}));
  EXPECT_EQ(pl::partition({6, 1, 1, 1, 1}, 3, {}, {0, 5, 1, 1, 1}, f1b),
            (std::vector<int>{0, 1, 2, 5}));
  // Heavy last unit, stages holding 1, 2, 3: [1 1 1][5] (max(6, 15) = 15) beats [1 1][1 5] (18).
  EXPECT_EQ(pl::partition({6, 1, 1, 1, 1}, 3, {}, {0, 1, 1, 1, 5}, {1, 2, 3}),
            (std::vector<int>{0, 1, 4, 5}));
  // Never slower: [1 1 1][1] would hold less (max(5, 15) against 30) but costs 3, not 2.
  EXPECT_EQ(pl::partition({1, 1, 1, 1}, 2, {}, {0, 0, 5, 5}, {1, 3}), (std::vector<int>{0, 2, 4}));
  // GPipe holds every micro-batch on every stage; zb holds up to pp on each (its deferred W's).
  EXPECT_EQ(pl::in_flight_per_stage(pl::build_schedule("gpipe", 3, 5)),
            (std::vector<int>{5, 5, 5}));
  for (int m : {3, 8}) {
    const std::vector<int> zb = pl::in_flight_per_stage(pl::build_schedule("zb", 3, m));
    for (int x : zb) EXPECT_LE(x, 3) << "zb m=" << m;
    EXPECT_EQ(zb[0], 3) << "zb m=" << m;
  }
}

TEST(PipelinePlan, LayoutsThePipelineCannotRunAreRefusedNamingTheKeys) {
  par::ParallelConfig p;
  p.pp = 2;
  const auto refused = [&](const std::string& acp, bool graph, const std::string& needle) {
    try {
      par::Plan::from(p, acp, graph, 4, 0);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  p.zero.stage = 3;
  refused("none", false, "parallel.zero.stage");
  p.zero.stage = 1;
  refused("none", true, "train.cuda_graph");
  p.pp_schedule = "zb";
  refused("full", false, "train.activation_checkpointing");
  p.pp_schedule = "1f1b";
  p.pp_virtual_stages = 2;
  refused("none", false, "parallel.pp_virtual_stages");
  p.pp_schedule = "interleaved";
  const par::Plan plan = par::Plan::from(p, "none", false, 4, 0);
  EXPECT_EQ(plan.describe(),
            "dp=2 x tp=1 x pp=2, ZeRO-1, pipeline interleaved x2 virtual stages, activation "
            "checkpointing none");
}

// The model transforms (LoRA, QAT, distillation) are checked against the layout where the plan is
// made, before anything is built: each refusal names both keys; the same settings pass where the
// transform runs (pp 1 and tp 1; distillation under ZeRO-1).
TEST(PipelinePlan, ModelTransformsAreCheckedAgainstTheLayout) {
  const auto refused = [](const par::ParallelConfig& p, const par::PlanTransforms& t,
                          const std::vector<std::string>& needles) {
    try {
      par::Plan::from(p, "none", false, 4, 0, t);
      ADD_FAILURE() << "accepted: " << needles.front();
    } catch (const ConfigError& e) {
      for (const auto& n : needles)
        EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
  };
  par::PlanTransforms lora, qat, distill;
  lora.lora = true;
  qat.qat = true;
  distill.distill = true;
  par::ParallelConfig pp2;
  pp2.pp = 2;
  refused(pp2, lora, {"'lora.rank'", "'parallel.pp'"});
  refused(pp2, qat, {"'qat.enabled'", "'parallel.pp'"});
  refused(pp2, distill, {"'distill.teacher'", "'parallel.pp'"});
  par::ParallelConfig tp2;
  tp2.tp = 2;
  refused(tp2, lora, {"'lora.rank'", "'parallel.tp'"});
  refused(tp2, qat, {"'qat.enabled'", "'parallel.tp'"});
  EXPECT_NO_THROW(par::Plan::from(tp2, "none", false, 4, 0, distill));
  par::ParallelConfig z3;
  z3.zero.stage = 3;
  refused(z3, distill, {"'distill.teacher'", "'parallel.zero.stage'"});
  par::ParallelConfig dp;
  for (const auto& t : {lora, qat, distill})
    EXPECT_NO_THROW(par::Plan::from(dp, "none", false, 4, 0, t));
  dp.zero.stage = 1;
  EXPECT_NO_THROW(par::Plan::from(dp, "none", false, 4, 0, distill));
}
