// Pipeline schedules as global plans (parallel.pp_schedule): for every pipeline rank, the ordered
// list of what it does in one training step, compute and communication alike. This file builds
// them (gpipe, 1f1b, interleaved, zb); parallel/pipeline/schedule_check.h checks and simulates a
// plan and prints it as a timeline (`parallax train --print-pp-schedule`), and only a checked plan
// is executed (parallel/pipeline/pipeline_engine.h).
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
// layout cannot run.
#pragma once

#include <string>
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
// "F", "B", "W", "send act", "recv act", "send grad", "recv grad".
const char* to_string(OpKind kind);

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

// ConfigError naming the keys: virtual stages per rank below 1, or more than 1 under a schedule
// other than interleaved. The one statement of that rule: build_schedule() and parallel::Plan
// (which validates the config before any schedule is built) both call it.
void check_virtual_stages(ScheduleKind kind, int virtual_stages);

// The plan of `kind` for `ranks` pipeline ranks, `micro_batches` micro-batches and
// `virtual_stages` chunks per rank. ConfigError naming the keys and numbers: an unknown kind,
// virtual stages with a schedule other than interleaved, interleaved with micro-batches not a
// multiple of the ranks (Megatron's constraint: the warm-up walks the chunks in groups of pp
// micro-batches), fewer micro-batches than 1. Fewer micro-batches than stages is allowed (gpipe,
// 1f1b, zb): the plan is just mostly bubble.
Schedule build_schedule(ScheduleKind kind, int ranks, int micro_batches, int virtual_stages = 1);
// The same by name (tests, tools): build_schedule(parse_schedule_kind(kind), ...).
Schedule build_schedule(const std::string& kind, int ranks, int micro_batches,
                        int virtual_stages = 1);

}  // namespace parallax::parallel::pipeline
