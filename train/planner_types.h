// The planner's value types (train/planner.h is its API): the bounds, the hardware a plan runs
// on, a candidate layout, and the predicted memory and time of one. The planner's internals
// (planner_inventory.h, planner_predict.h) and its API share them.
#pragma once

#include "parallel/memory_rules.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace parallax::train::planner {

// The planner's bounds (docs/planning.md, "Limits"). Beyond them plan() and predict() refuse the
// request (UsageError naming the flag, or a rejected layout naming the keys) instead of running
// for minutes or allocating without bound (issue 35).
// Ranks in all: beyond the largest clusters built (~100k GPUs). The enumeration is over the
// divisor pairs (tp, pp) of --gpus, never over the ranks themselves.
constexpr int kMaxGpus = 1 << 17;
// Samples per optimizer step: the micro-batch size and count of a layout are int keys
// (data.batch_size, train.grad_accum).
constexpr int64_t kMaxGlobalBatch = 2147483647;
// A pipeline layout's schedule is built and simulated op by op, pp x virtual stages x micro-batches
// compute passes of each kind: at most this many (e.g. pp 64 x 1024 micro-batches), so a layout
// costs milliseconds and kilobytes, not the minutes and gigabytes that 10^9 micro-batches took.
constexpr int64_t kMaxPipelineSlots = 1 << 16;

// What the layouts run on. Defaults: the documented H100 SXM numbers (docs/planning.md);
// calibrate() replaces efficiency (and peak, on the CPU) with measured ones.
struct Hardware {
  std::string name = "H100 80GB";
  bool cuda = true;
  int gpus = 1;  // ranks in all
  int nodes = 1;
  double gpu_mem_gib = 80;          // per rank
  double peak_tflops = 989;         // dense peak of the compute dtype (bf16/fp16; fp32 runs: tf32)
  double efficiency = 0.45;         // achieved fraction of the peak on the model's own GEMMs
  double intra_node_gbps = 360;     // bus bandwidth of a collective inside a node, GB/s (NVLink)
  double inter_node_gbps = 50;      // bus bandwidth across nodes, GB/s (--inter-node-gbps / 8)
  double context_gib = 0.55;        // CUDA context, cuBLAS workspace: outside the allocator
  double latency_us = 15;           // per collective or point-to-point message
  double overhead_ms = 0;           // fixed cost of one micro-batch's forward + backward (launches)
  double host_floor_ms = 0;         // the shortest step the host can issue (calibrated)
  std::string source = "defaults";  // "defaults" | "calibrated on ..."
  int gpus_per_node() const { return gpus / nodes; }
};

// One layout to consider: a candidate of the planner's enumeration (a parallel layout with its
// micro-batching, schedule and activation checkpointing), not comm::topology's rank layout.
struct Candidate {
  int dp = 1, tp = 1, pp = 1;
  int zero = 0;
  bool sequence_parallel = false;
  int64_t micro_batch = 1;  // data.batch_size
  int micro_batches = 1;    // train.grad_accum
  std::string schedule;     // pp > 1
  int virtual_stages = 1;
  std::string checkpointing = "none";  // none | selective | full
  // The config overrides that select this layout.
  std::string overrides() const;
};

// One rank's predicted memory, bytes.
struct RankMemory {
  int rank = 0;
  int64_t params = 0, grads = 0, optimizer = 0;  // exactly what Engine::memory() reports
  double activations = 0;                        // saved for backward at the schedule's peak
  double autocast_copies = 0;     // low-precision weight casts autocast keeps for the step
  double transient = 0;           // the largest unit's recomputation or backward temporaries
  double comm_buffers = 0;        // reduced-precision / gathered copies the collectives need
  double context = 0;             // CUDA context (not in the allocator)
  int64_t grads_at_backward = 0;  // gradient bytes already held when the backward starts
  // The allocator's peak: at the start of the backward every activation is alive (with the
  // gradients that persist between steps and the first unit's backward temporaries); by its end
  // the activations are freed and every gradient exists.
  double allocated() const {
    return static_cast<double>(params + optimizer) + autocast_copies + comm_buffers +
           std::max(static_cast<double>(grads_at_backward) + activations + transient,
                    static_cast<double>(grads) + transient);
  }
  double total() const { return allocated() + context; }
};

struct StepTime {
  double compute_ms = 0;     // forward + backward (+ recomputation) of one rank's stages
  double bubble_ms = 0;      // pipeline idle time
  double tp_comm_ms = 0;     // tensor-parallel collectives (on the critical path)
  double pp_comm_ms = 0;     // point-to-point messages (exposed)
  double dp_comm_ms = 0;     // gradient reduction and parameter gathers
  double dp_exposed_ms = 0;  // the part not hidden behind the backward
  double optimizer_ms = 0;   // the optimizer update (memory bound)
  double step_ms = 0;
  double samples_per_s = 0;
};

struct Row {
  Candidate layout;
  std::vector<RankMemory> ranks;  // one per pipeline rank (dp and tp ranks hold the same up to
                                  // ZeRO's uneven shards: the largest is kept)
  RankMemory peak;                // the rank with the most memory
  StepTime time;
  bool fits = false;
  std::string reason;       // why it cannot run (empty when it can)
  bool configured = false;  // the config's own layout
};

struct Request {
  Hardware hw;
  int64_t global_batch =
      0;  // 0: data.batch_size x train.grad_accum x gpus / (tp x pp) of the config
  bool all_checkpointing = true;  // also consider selective and full checkpointing
};

}  // namespace parallax::train::planner
