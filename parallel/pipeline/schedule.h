// Pipeline schedules as global plans (parallel.pp_schedule): for every pipeline rank, the ordered
// list of what it does in one training step, compute and communication alike. A plan is built,
// checked (every send has its receive, every compute op has its inputs, no rank waits forever),
// and only then executed (parallel/pipeline/pipeline_engine.h); `parallax train
// --print-pp-schedule` prints it as a timeline.
//
// Stages. The model's units are cut into S = pp * v contiguous stages (v = virtual stages per
// rank, 1 except for the interleaved schedule). Stage s lives on pipeline rank s % pp as its chunk
// s / pp (Megatron's interleaved placement: rank r holds stages r, r + pp, r + 2 pp, ...).
//
// Ops. F(m, s): the forward of micro-batch m through stage s. B(m, s): its backward (the whole
// backward; under zb only the gradient of the stage's input). W(m, s): zb's deferred
// weight-gradient pass. SendAct/RecvAct (m, s) move stage s's output to stage s + 1, and
// SendGrad/RecvGrad (m, s) the gradient of stage s's input to stage s - 1: a message is named by
// the stage that produces it. The engine posts each communication op where the plan lists it
// (at the places Megatron-LM puts them: schedule.cpp, with_comm), never waits for a send before
// the end of the step, and waits for a receive right before the compute op that consumes it.
//
// Thread-safety: plain values. Errors: ConfigError naming the keys and numbers for a schedule the
// layout cannot run; parallax::Error naming the rank, op and peer for a plan that fails check().
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace parallax::parallel::pipeline {

enum class OpKind { kForward, kBackward, kWeight, kSendAct, kRecvAct, kSendGrad, kRecvGrad };

struct Op {
  OpKind kind;
  int micro = 0;  // micro-batch
  int stage = 0;  // global stage (for messages: the stage that produced them)
  int peer = -1;  // communication: the other pipeline rank
  bool is_comm() const { return kind >= OpKind::kSendAct; }
  bool is_send() const { return kind == OpKind::kSendAct || kind == OpKind::kSendGrad; }
};

// "F3s1", "B0s2", "W1s0", "send act m3 s1 -> r2", ...
std::string to_string(const Op& op);

// parallel.pp_schedule, parsed once (parse_schedule_kind).
enum class ScheduleKind { kGpipe, k1F1B, kInterleaved, kZb };
// "gpipe" | "1f1b" | "interleaved" | "zb".
const char* to_string(ScheduleKind kind);
// ConfigError naming parallel.pp_schedule for an unknown name.
ScheduleKind parse_schedule_kind(const std::string& name);

struct Schedule {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int ranks = 1;                     // pp
  int virtual_stages = 1;            // v (chunks per rank)
  int micro_batches = 1;             // m
  std::vector<std::vector<Op>> ops;  // ops[r]: pipeline rank r's step, in order

  int stages() const { return ranks * virtual_stages; }
  int rank_of(int stage) const { return stage % ranks; }
  int chunk_of(int stage) const { return stage / ranks; }
  bool split_backward() const { return kind == ScheduleKind::kZb; }
  const char* name() const { return to_string(kind); }
};

// The plan of `kind` for `ranks` pipeline ranks, `micro` micro-batches and `virtual_stages`
// chunks per rank. ConfigError naming the keys and numbers: an unknown kind, virtual stages with a
// schedule other than interleaved, interleaved with micro-batches not a multiple of the ranks
// (Megatron's constraint: the warm-up walks the chunks in groups of pp micro-batches), fewer
// micro-batches than 1. Fewer micro-batches than stages is allowed (gpipe, 1f1b, zb): the plan is
// just mostly bubble.
Schedule build_schedule(ScheduleKind kind, int ranks, int micro, int virtual_stages = 1);
// The same by name (tests, tools): build_schedule(parse_schedule_kind(kind), ...).
Schedule build_schedule(const std::string& kind, int ranks, int micro, int virtual_stages = 1);

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
