// `parallax plan`: every parallel layout of a config on N GPUs (or CPU ranks), with its predicted
// memory per rank and step time, ranked (train/planner.h, docs/planning.md).
#include "comm/bandwidth.h"
#include "comm/world.h"
#include "core/error.h"
#include "core/log.h"
#include "core/timer.h"
#include "launch/agent.h"
#include "launch/args.h"
#include "launch/bootstrap.h"
#include "launch/exit_codes.h"
#include "launch/verbs.h"
#include "train/planner.h"
#include "train/planner_calibrate.h"
#include "train/run_config.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

namespace parallax::launch {

namespace {

// Bounds of the flags that are not the planner's own (train/planner.h holds those), stated in
// docs/planning.md, "Limits".
constexpr double kMaxGpuMemGib = 1 << 20;  // 1 PiB per GPU: any real device is far below
constexpr double kMaxGbps = 1e6;           // 1 Pbit/s per GPU across nodes
// --calibrate trains real steps at this batch and doublings of it up to 16x.
constexpr int64_t kMaxCalibrateBatch = 1 << 16;
// The calibration all-reduce: each rank holds a buffer of this size.
constexpr int64_t kMaxBandwidthMib = 1 << 12;

// The documented numbers of the GPUs we measure on (docs/planning.md, "Defaults").
train::planner::Hardware hardware_for(const std::string& device) {
  train::planner::Hardware hw;
  if (device == "h100") return hw;
  if (device == "h200") {
    hw.name = "H200 141GB";
    hw.gpu_mem_gib = 140;
    return hw;
  }
  if (device == "cpu") {
    hw.name = "CPU ranks";
    hw.cuda = false;
    hw.gpu_mem_gib = 16;
    hw.peak_tflops = 0.1;
    hw.efficiency = 0.5;
    hw.intra_node_gbps = 5;
    hw.inter_node_gbps = 1;
    hw.context_gib = 0;
    hw.latency_us = 50;
    return hw;
  }
  throw_error<UsageError>("plan: --device '{}': expected h100, h200 or cpu", device);
}

// `plan --measure-bandwidth FILE` (the workers that `plan --calibrate` starts through the
// launcher, one per local GPU or CPU rank): the bus bandwidth of an all-reduce of `mib` MiB of
// float32 over this world (NCCL on GPUs, gloo on CPUs), 2 warm-up calls then `reps` timed ones,
// each waited for; busbw = 2 (n-1)/n x bytes / time (nccl-tests' definition), the slowest rank's
// time. The buffer holds ones and is averaged, so it must stay all ones: a wrong reduction is an
// error rather than a number. Rank 0 writes the bandwidth in GB/s to FILE (and logs the figures).
int measure_bandwidth(const std::string& file, bool cuda, int64_t mib) {
  const auto world = bootstrap_world();  // this worker's, from the launcher's environment
  const comm::Bandwidth b = comm::measure_bus_bandwidth(*world, cuda, mib);
  if (b.rank == 0) {
    std::ofstream f(file);
    f << fmt::format("{}\n", b.busbw_gbps);  // shortest round-trip form: read back exactly
    PARALLAX_CHECK(f.good(), IoError, "plan --measure-bandwidth: cannot write '{}'", file);
    core::log::info(
        "plan --measure-bandwidth: {} over {} ranks, {:.0f} bytes in {:.6f} s: {:.2f} GB/s",
        b.backend, b.ranks, b.bytes, b.seconds, b.busbw_gbps);
  }
  return 0;
}

// --calibrate's bandwidth step: `ranks` workers of this binary on this node through the launcher's
// agent (standalone store, a deadline on every wait), each running measure_bandwidth(). Returns
// the measured bus bandwidth in GB/s; throws naming the launcher's exit code and the log folder.
double calibrate_bandwidth(int ranks, bool cuda, int64_t mib) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / fmt::format("parallax_bandwidth_{}", ::getpid());
  fs::create_directories(dir);
  const fs::path out = dir / "bandwidth.json";
  AgentOptions a;
  a.nproc_per_node = ranks;
  a.master_port = 0;
  a.rdzv_timeout_s = 120;
  a.grace_period_s = 5;
  a.log_dir = (dir / "logs").string();
  a.exe = self_exe();
  a.worker_args = {"plan",
                   "--measure-bandwidth",
                   out.string(),
                   "--device",
                   cuda ? "h100" : "cpu",
                   "--bandwidth-mib",
                   std::to_string(mib)};
  const int rc = run_agent(a);
  PARALLAX_CHECK(
      rc == kExitOk, Error,
      "plan --calibrate: the bandwidth measurement over {} local ranks failed (launcher exit "
      "code {}); the workers' logs are in {}",
      ranks, rc, a.log_dir);
  double gbps = 0;
  std::ifstream f(out);
  PARALLAX_CHECK(f >> gbps && gbps > 0, Error,
                 "plan --calibrate: the bandwidth workers wrote no result to {}", out.string());
  std::error_code ec;
  fs::remove_all(dir, ec);
  return gbps;
}

// The verb's command line.
Args plan_args() {
  Args args("plan",
            "Which parallel layout to run a config on N GPUs of M GiB, and why: every valid "
            "combination of dp x tp x pp, ZeRO stage, sequence parallelism, micro-batch size and "
            "count, pipeline schedule and activation checkpointing, with its memory per GPU "
            "(parameters, gradients, optimizer state, activations, the rest) and its step time "
            "(compute, bubble, exposed communication), ranked by predicted throughput. Layouts "
            "that cannot run are listed with the reason.");
  args.option("config", "FILE", "the run's YAML config")
      .option("gpus", "N", "GPUs (or CPU ranks) in all", "1")
      .option("nodes", "M", "nodes (the GPUs are split evenly)", "1")
      .option("gpu-mem", "GiB", "memory per GPU (default: the device's)")
      .option("device", "NAME", "h100 | h200 | cpu: the default peak, bandwidths and memory",
              "h100")
      .option("global-batch", "B",
              "samples per optimizer step (default: data.batch_size x train.grad_accum x gpus / "
              "(tp x pp) of the config)")
      .option("inter-node-gbps", "Gbit/s", "network bandwidth per GPU across nodes", "400")
      .option("efficiency", "F",
              "achieved fraction of the peak FLOP/s (default 0.45; see --calibrate)")
      .flag("calibrate",
            "measure the compute efficiency with a few training steps of the model on this "
            "machine (one process), and the all-reduce bandwidth in a node over min(GPUs per "
            "node, this machine's GPUs) ranks, instead of the documented defaults")
      .option("calibrate-batch", "N", "--calibrate's micro-batch (default: data.batch_size)")
      .option("bandwidth-mib", "MiB",
              "--calibrate's all-reduce size for the bandwidth in a node (default: 256 on GPUs, 16 "
              "on CPU ranks)")
      .option("measure-bandwidth", "FILE",
              "internal: the bandwidth workers that --calibrate starts (one all-reduce measurement "
              "over this world, written to FILE)")
      .option("top", "K", "rows of the table (0: every layout that fits)", "15")
      .option("json", "FILE",
              "also write every layout (fitting and rejected) as JSON ('-': stdout)")
      .flag("only-config", "predict only the config's own layout (its parallel keys) on --gpus")
      .overrides("config overrides, e.g. model.size=3b data.batch_size=8")
      .epilog(
          "examples:\n"
          "  parallax plan --config configs/bench/w2_bev_base.yaml --gpus 8 --gpu-mem 80\n"
          "  parallax plan --config configs/bench/w2_bev_base.yaml --gpus 16 --nodes 2 "
          "model.size=3b\n"
          "  parallax plan --config configs/bench/w1_vit_b16.yaml --gpus 1 --calibrate\n"
          "  parallax plan --config configs/bev_tiny.yaml --device cpu --gpus 4 --json plan.json");
  return args;
}

// --calibrate: the compute efficiency from training steps of the model in this process, and the
// all-reduce bandwidth in a node from workers started through the launcher (`mib(cuda)`: their
// buffer).
void calibrate_hardware(train::planner::Request& req, const train::RunConfig& cfg,
                        int64_t calibrate_batch,
                        const std::function<int64_t(bool)>& bandwidth_mib) {
  const auto world = bootstrap_world();  // the calibration runs the trainer in this process
  PARALLAX_CHECK(world->size() == 1, UsageError,
                 "plan --calibrate runs one process; start it without mpirun or torchrun");
  req.hw = train::planner::calibrate(cfg, req.hw, 20, calibrate_batch);
  // The bandwidth in a node: one all-reduce over as many local ranks as a node of the plan
  // has, up to this machine's GPUs (CPU ranks: any number). Across nodes stays
  // --inter-node-gbps: one machine cannot measure the network. CPU ranks: up to this
  // machine's cores (the launcher's own cap: one CPU worker per core).
  const int local = req.hw.cuda ? world->cuda_device_count() : usable_cpu_cores();
  const int ranks = std::min(req.hw.gpus_per_node(), local);
  const int64_t mib = bandwidth_mib(req.hw.cuda);
  if (ranks >= 2) {
    req.hw.intra_node_gbps = calibrate_bandwidth(ranks, req.hw.cuda, mib);
    req.hw.source +=
        fmt::format("; all-reduce bus bandwidth {:.2f} GB/s over {} local ranks ({} MiB)",
                    req.hw.intra_node_gbps, ranks, mib);
  } else {
    req.hw.source += fmt::format(
        "; bandwidth in a node: the default (a node of {} rank(s) on a "
        "machine with {} has no all-reduce to measure)",
        req.hw.gpus_per_node(), local);
  }
}

// --json: every layout (fitting and rejected), and with --only-config every world rank's exact
// Engine::memory() (what the trainer's "memory" metrics row reports).
void write_plan_json(const Args& args, const std::vector<train::planner::Row>& rows,
                     const train::planner::Request& req, const train::RunConfig& cfg) {
  std::string doc = train::planner::render_json(rows, req.hw);
  if (args.flag_set("only-config")) {
    // Every world rank's exact Engine::memory() (what the trainer's "memory" metrics row
    // reports).
    std::string ranks;
    for (const auto& m : train::planner::engine_memory(cfg, req.hw.gpus, req.hw.cuda)) {
      ranks += fmt::format("{}{{\"params\": {}, \"grads\": {}, \"optimizer\": {}}}",
                           ranks.empty() ? "" : ", ", m.params, m.grads, m.optimizer);
    }
    doc = doc.substr(0, doc.rfind(']')) + "],\n \"engine_memory\": [" + ranks + "]}\n";
  }
  if (args.get("json") == "-") {
    std::fputs(doc.c_str(), stdout);
  } else {
    std::ofstream f(args.get("json"));
    f << doc;
    PARALLAX_CHECK(f.good(), IoError, "plan: cannot write '{}'", args.get("json"));
  }
}

}  // namespace

int verb_plan(const std::vector<std::string>& argv) {
  Args args = plan_args();
  args.parse(argv);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  // Every number is range-checked here, naming its flag (docs/planning.md, "Limits").
  const auto bandwidth_mib = [&](bool cuda) -> int64_t {
    return args.has("bandwidth-mib")
               ? args.get_int("bandwidth-mib", 1, kMaxBandwidthMib,
                              "each rank holds a buffer of this size; the bus bandwidth "
                              "saturates well below it")
               : (cuda ? 256 : 16);
  };
  (void)bandwidth_mib(true);  // checked before anything runs, not after the calibration's steps
  if (args.has("measure-bandwidth")) {
    const bool cuda = args.get("device") != "cpu";
    return measure_bandwidth(args.get("measure-bandwidth"), cuda, bandwidth_mib(cuda));
  }
  PARALLAX_CHECK(args.has("config"), UsageError, "plan: --config FILE is required");
  train::planner::Request req;
  req.hw = hardware_for(args.get("device"));
  req.hw.gpus = static_cast<int>(args.get_int("gpus", 1, train::planner::kMaxGpus,
                                              "the largest clusters built have ~100k GPUs"));
  req.hw.nodes =
      static_cast<int>(args.get_int("nodes", 1, req.hw.gpus, "one GPU per node at least"));
  PARALLAX_CHECK(req.hw.gpus % req.hw.nodes == 0, UsageError,
                 "plan: --gpus {} must be a positive multiple of --nodes {}", req.hw.gpus,
                 req.hw.nodes);
  if (args.has("gpu-mem")) req.hw.gpu_mem_gib = args.get_double("gpu-mem", 0, kMaxGpuMemGib, true);
  if (args.has("efficiency")) req.hw.efficiency = args.get_double("efficiency", 0, 1, true);
  req.hw.inter_node_gbps = args.get_double("inter-node-gbps", 0, kMaxGbps, true) / 8.0;
  if (args.has("global-batch")) {
    req.global_batch = args.get_int("global-batch", 1, train::planner::kMaxGlobalBatch,
                                    "a layout's micro-batch size and count are 32-bit keys");
  }
  // 0: every fitting layout.
  const int top =
      static_cast<int>(args.get_int("top", 0, std::numeric_limits<int>::max(), "0 shows all"));
  const int64_t calibrate_batch =
      args.has("calibrate-batch") ? args.get_int("calibrate-batch", 1, kMaxCalibrateBatch) : 0;
  core::log::set_level(core::log::Level::kWarn);
  train::RunConfig cfg = train::load_run_config(args.get("config"), args.override_args());
  if (args.flag_set("calibrate")) calibrate_hardware(req, cfg, calibrate_batch, bandwidth_mib);

  std::vector<train::planner::Row> rows;
  if (args.flag_set("only-config")) {
    auto row =
        train::planner::predict(cfg, train::planner::configured_layout(cfg, req.hw.gpus), req.hw);
    row.configured = true;
    rows.push_back(row);
  } else {
    rows = train::planner::plan(cfg, req);
  }
  std::fputs(train::planner::render_table(rows, req.hw, top).c_str(), stdout);
  if (args.has("json")) write_plan_json(args, rows, req, cfg);
  return 0;
}

}  // namespace parallax::launch
