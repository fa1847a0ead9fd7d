// What a pipeline plan (parallel/pipeline/schedule.h) does when it runs, worked out before it
// runs: check() proves it complete and free of waits under each backend's rule,
// check_posting_order() proves it safe on a transport that matches messages by order,
// comm_batches() groups each rank's communication into the batches the engine posts,
// in_flight_per_stage() counts the activations each stage holds (the partition's and the
// planner's memory input), and simulate() / render() give its timeline and bubble.
//
// Thread-safety: plain functions of plain values. Errors: parallax::Error naming the rank, op and
// peer for a plan that fails a check.
#pragma once

#include "parallel/pipeline/schedule.h"

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace parallax::parallel::pipeline {

// Checks the plan before the first step by running it as the engine does, under each backend's
// rule. Independent progress (MPI, gloo): posting a send or a receive never blocks, a compute op
// waits for the message it consumes. NCCL: each rank's batches (comm_batches) run one at a time
// in plan order on one stream, each after the compute ops listed before it; a batch is one NCCL
// group and moves only as a whole, while the batches holding the other ends of all its messages
// run and move too (no buffering: a large send waits for its receive; and a group's sends may wait
// on its receives); a compute op waits for the batch holding its input.
// Every F, B and W of every
// (micro-batch, stage) appears exactly once on the stage's rank; every F(m, s > 0) follows its
// RecvAct, every B follows its F and, on all but the last stage, its RecvGrad; every W follows its
// B; every send has exactly one matching receive on the right peer and vice versa; and no rank
// waits forever. Throws parallax::Error naming the first rank, op and peer that break a rule
// ("pipeline plan '1f1b': rank 1 op 7 (recv act m2 s0 <- r0) has no matching send on rank 0").
void check(const Schedule& s);

// For a transport that matches point-to-point messages by order rather than by tag (NCCL: the
// k-th send from rank a to rank b meets the k-th receive that b posts from a): the engine posts
// every message where the plan lists it, so for every ordered pair of ranks the sender's plan must
// list its sends to the receiver in the order the receiver's plan lists their receives. Throws
// parallax::Error naming the pair, the two messages and the ops where the orders part ("pipeline
// plan '1f1b' (...): rank 1 posts its receive of the activations of micro-batch 1 from stage 0
// (op 1) as message #1 from rank 0, but rank 0 posts the activations of micro-batch 0 ...").
void check_posting_order(const Schedule& s);

// How the ranks group their sends and receives into NCCL calls, for simulate_nccl.
enum class NcclBatching {
  kMatched,     // comm_batches(): what the engine posts
  kRuns,        // each run of communication ops between two compute ops as one group
  kPerMessage,  // every send and receive its own call (separate send()/recv() on one stream)
};

// The plan under NCCL's rule (check()'s comment); throws parallax::Error naming each rank's
// stuck batch or op if it deadlocks. With kPerMessage, 1F1B's steady state deadlocks (two
// neighbours each sending before they receive); with kRuns, GPipe does (stage 0's group of its
// last activation send and first gradient receive waits for stage 1's gradient, which needs that
// activation: the hang on 2 x H200, 2026-11-29). `connect_up_front`: every direction between two
// ranks is connected before the first batch, as PipelineEngine::connect_peers() does; false
// models NCCL's default, where the first ncclGroupEnd that uses a direction connects it and
// blocks until the peer's current group uses it too (with kRuns, GPipe then hangs in posting).
void simulate_nccl(const Schedule& s, NcclBatching batching = NcclBatching::kMatched,
                   bool connect_up_front = true);

// The communication batches of every rank's plan, as [first, end) op indices: each maximal run of
// consecutive send and receive ops, cut until all of a batch's messages with one peer are in one
// batch of that peer (so the two ends of an exchange post it as one group each, as NCCL asks:
// NVIDIA/nccl#1279). GPipe's stage 0 thus posts its last activation send and its first gradient
// receive apart; 1F1B's send_forward_recv_backward pairs stay one batch. The engine posts each as
// one batch_isend_irecv.
std::vector<std::vector<std::pair<std::size_t, std::size_t>>> comm_batches(const Schedule& s);
// Rank `rank`'s batches of comm_batches(s).
std::vector<std::pair<std::size_t, std::size_t>> comm_batches(const Schedule& s, int rank);

// For each stage, the most micro-batches whose activations it holds at once under the plan: from
// their F to their B (under zb, to their W, whose weight pass still reads them). 1F1B: pp - r on
// rank r; GPipe: m.
std::vector<int> in_flight_per_stage(const Schedule& s);

// The plan's timeline with nominal op costs (F = 1, B = 2, or under zb B = 1 and W = 1;
// communication free), from the same simulation check() runs.
struct Timeline {
  struct Slot {
    int rank;
    Op op;
    double start, end;
  };
  std::vector<Slot> slots;  // compute ops only
  double makespan = 0;
  double busy_per_rank = 0;  // compute time of one rank (equal on every rank)
  // Idle time over compute time, the bubble fraction of the pipeline literature: (p - 1) / m for
  // 1F1B with uniform stages.
  double bubble() const {
    return busy_per_rank > 0 ? (makespan - busy_per_rank) / busy_per_rank : 0;
  }
};
Timeline simulate(const Schedule& s, double forward_cost = 1, double backward_cost = 2,
                  double weight_cost = 0);

// The timeline as text: one row per rank, one column per time unit, "F3" / "B3" / "W3" cells
// (with ".c<chunk>" under interleaving), "." for idle; then the bubble fraction against its
// formula.
std::string render(const Schedule& s);

// The formula's bubble fraction: (p - 1) / m (gpipe, 1f1b), (p - 1) / (m v) (interleaved), and
// for zb (ZB-H1, Qi et al. 2024) (p - 1)(F + B - W) / (m (F + B + W)) with F = B = W = 1:
// (p - 1) / (3 m).
double formula_bubble(const Schedule& s);

}  // namespace parallax::parallel::pipeline
