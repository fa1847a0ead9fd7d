// The `parallel` config section: the DP x TP x PP layout, the communication backend and its
// timeouts, and the DDP engine's options. The engines and the comm layer receive plain option
// structs built from it; nothing below `parallel/` reads config.
#pragma once

#include "core/config.h"

#include <string>
#include <vector>

namespace parallax::parallel {

struct DdpConfig {
  std::string bucket_mode = "auto";
  std::string reduce_dtype = "grad";
  double bucket_mb = 25.0;
  double first_bucket_mb = 1.0;
  bool find_unused = false;
  bool broadcast_buffers = true;

  template <class V>
  void visit(V& v) {
    v("bucket_mode", bucket_mode,
      "gradient buckets: flat (gradients are views of one buffer per bucket), grouped (each "
      "gradient "
      "all-reduced in place, one NCCL group per bucket; native all-reduce in the gradients' dtype "
      "only), or auto "
      "(grouped on NCCL with the native all-reduce and no reduce_dtype, else flat)",
      core::Check::one_of({"auto", "flat", "grouped"}));
    v("reduce_dtype", reduce_dtype,
      "dtype gradients are all-reduced in: grad (their own, fp32 as PyTorch DDP), or bf16/fp16 "
      "(half the bytes, "
      "the average rounded to that dtype, as PyTorch's bf16_compress_hook; flat buckets only)",
      core::Check::one_of({"grad", "bf16", "fp16"}));
    v("bucket_mb", bucket_mb, "gradient bucket cap in MiB (PyTorch DDP: 25)",
      core::Check::positive());
    v("first_bucket_mb", first_bucket_mb,
      "cap of the first bucket in MiB, so communication starts early", core::Check::positive());
    v("find_unused", find_unused, "tolerate parameters that get no gradient in a step");
    v("broadcast_buffers", broadcast_buffers,
      "broadcast buffers (e.g. BatchNorm stats) from rank 0 every step");
  }
};

struct ZeroConfig {
  int stage = 0;
  bool prefetch = true;

  template <class V>
  void visit(V& v) {
    v("stage", stage,
      "ZeRO stage over the data-parallel group: 0 (DDP: everything replicated), 1 (optimizer state "
      "and fp32 "
      "masters sharded), 2 (1 + gradients reduce-scattered into shards), 3 (2 + parameters "
      "sharded, "
      "gathered unit by unit around each forward and backward)",
      core::Check::between(0, 3));
    v("prefetch", prefetch,
      "ZeRO-3: gather the next unit's parameters while the current one computes");
  }
};

struct ParallelConfig {
  int dp = 0;  // 0: world / (tp * pp)
  int tp = 1;
  int pp = 1;
  std::string pp_schedule = "1f1b";
  int pp_virtual_stages = 1;
  std::vector<int> pp_layout;  // units per stage; empty: balanced
  bool sequence_parallel = false;
  bool meta_init = true;
  std::string backend = "auto";
  std::string allreduce = "native";
  double timeout_s = 600;
  double init_timeout_s = 300;
  double checkpoint_timeout_s = 1800;
  bool debug_collectives = false;
  int flight_recorder_size = 512;
  double ring_chunk_mb = 0;  // 0: the backend's default
  bool nccl_blocking = true;
  int gpus_per_node = 0;  // 0: detect
  DdpConfig ddp;
  ZeroConfig zero;

  template <class V>
  void visit(V& v) {
    v("dp", dp, "data-parallel degree (0: world / (tp * pp))", core::Check::at_least(0));
    v("tp", tp, "tensor-parallel degree (innermost, contiguous ranks)", core::Check::at_least(1));
    v("pp", pp, "pipeline-parallel degree (outermost)", core::Check::at_least(1));
    v("pp_schedule", pp_schedule,
      "pipeline schedule over the step's micro-batches (train.grad_accum of them): gpipe, 1f1b, "
      "interleaved (with pp_virtual_stages), zb (ZB-H1 zero bubble: backward split into input "
      "and weight passes)",
      core::Check::one_of({"gpipe", "1f1b", "interleaved", "zb"}));
    v("pp_virtual_stages", pp_virtual_stages,
      "interleaved schedule: model chunks per pipeline rank (stages = pp x this)",
      core::Check::at_least(1));
    v("pp_layout", pp_layout,
      "units per pipeline stage, in order (e.g. [5, 7]); empty: balanced by the units' cost");
    v("sequence_parallel", sequence_parallel,
      "with tp > 1: shard LayerNorm, dropout and residual regions along the tokens (all-gather "
      "before each column-parallel layer, reduce-scatter after each row-parallel one)");
    v("meta_init", meta_init,
      "ZeRO-3 over several ranks, or pipeline stages: build the model without storage and "
      "materialise only what this rank owns (its shard, unit by unit, or its stages) with the "
      "values a full build gives, or read tensor by tensor from train.load_from or a resumed "
      "checkpoint, so no rank holds the whole model; also under LoRA and QAT (not under "
      "distillation, whose runs build whole); false: every rank builds the whole model");
    v("backend", backend, "communication backend",
      core::Check::one_of({"auto", "mpi", "nccl", "gloo"}));
    v("allreduce", allreduce, "all-reduce algorithm: backend native or the explicit ring",
      core::Check::one_of({"native", "ring"}));
    v("timeout_s", timeout_s, "timeout of a steady-state collective", core::Check::positive());
    v("init_timeout_s", init_timeout_s,
      "the start-up deadline: every wait before the first step (MPI init, the store, the "
      "rendezvous, communicator creation) ends within the smallest of this, timeout_s and "
      "$PARALLAX_STARTUP_TIMEOUT (parallax launch --startup-timeout)",
      core::Check::positive());
    v("checkpoint_timeout_s", checkpoint_timeout_s, "timeout of checkpoint barriers",
      core::Check::positive());
    v("debug_collectives", debug_collectives,
      "cross-check op, group and shape across ranks before each collective");
    v("flight_recorder_size", flight_recorder_size, "collectives kept per rank for hang reports",
      core::Check::at_least(1));
    v("ring_chunk_mb", ring_chunk_mb,
      "pipelining chunk of the ring all-reduce in MiB (0: backend default)",
      core::Check::at_least(0));
    v("nccl_blocking", nccl_blocking,
      "NCCL collectives on blocking communicators (~70 us less per call; connections made at "
      "creation); false: every call on non-blocking communicators");
    v("gpus_per_node", gpus_per_node, "GPUs per node for layout checks (0: detect)",
      core::Check::at_least(0));
    v("ddp", ddp);
    v("zero", zero);
  }
};

}  // namespace parallax::parallel
