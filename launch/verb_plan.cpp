// `parallax plan`: every parallel layout of a config on N GPUs (or CPU ranks), with its predicted
// memory per rank and step time, ranked (train/planner.h, docs/planning.md).
#include "core/error.h"
#include "core/log.h"
#include "launch/args.h"
#include "launch/verbs.h"
#include "parallel/comm/world.h"
#include "train/planner.h"
#include "train/run_config.h"

#include <fmt/format.h>

#include <cstdio>
#include <fstream>

namespace parallax::launch {

namespace {

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

}  // namespace

int verb_plan(const std::vector<std::string>& argv) {
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
      .option("device", "NAME", "h100 | h200 | cpu: the default peak, bandwidths and memory", "h100")
      .option("global-batch", "B",
              "samples per optimizer step (default: data.batch_size x train.grad_accum x gpus / "
              "(tp x pp) of the config)")
      .option("inter-node-gbps", "Gbit/s", "network bandwidth per GPU across nodes", "400")
      .option("efficiency", "F", "achieved fraction of the peak FLOP/s (default 0.45; see --calibrate)")
      .flag("calibrate",
            "measure the compute efficiency with a few training steps of the model on this "
            "machine (one process) instead of the documented default")
      .option("calibrate-batch", "N", "--calibrate's micro-batch (default: data.batch_size)")
      .option("top", "K", "rows of the table", "15")
      .option("json", "FILE", "also write every layout (fitting and rejected) as JSON ('-': stdout)")
      .flag("only-config", "predict only the config's own layout (its parallel keys) on --gpus")
      .overrides("config overrides, e.g. model.size=3b data.batch_size=8")
      .epilog(
          "examples:\n"
          "  parallax plan --config configs/bench/w2_bev_base.yaml --gpus 8 --gpu-mem 80\n"
          "  parallax plan --config configs/bench/w2_bev_base.yaml --gpus 16 --nodes 2 model.size=3b\n"
          "  parallax plan --config configs/bench/w1_vit_b16.yaml --gpus 1 --calibrate\n"
          "  parallax plan --config configs/bev_tiny.yaml --device cpu --gpus 4 --json plan.json");
  args.parse(argv);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  PARALLAX_CHECK(args.has("config"), UsageError, "plan: --config FILE is required");
  core::log::set_level(core::log::Level::kWarn);
  train::RunConfig cfg = train::load_run_config(args.get("config"), args.override_args());
  train::planner::Request req;
  req.hw = hardware_for(args.get("device"));
  req.hw.gpus = static_cast<int>(args.get_int("gpus"));
  req.hw.nodes = static_cast<int>(args.get_int("nodes"));
  PARALLAX_CHECK(req.hw.gpus >= 1 && req.hw.nodes >= 1 && req.hw.gpus % req.hw.nodes == 0,
                 UsageError, "plan: --gpus {} must be a positive multiple of --nodes {}",
                 req.hw.gpus, req.hw.nodes);
  if (args.has("gpu-mem")) req.hw.gpu_mem_gib = args.get_double("gpu-mem");
  if (args.has("efficiency")) req.hw.efficiency = args.get_double("efficiency");
  req.hw.inter_node_gbps = args.get_double("inter-node-gbps") / 8.0;
  if (args.has("global-batch")) req.global_batch = args.get_int("global-batch");
  PARALLAX_CHECK(req.hw.gpu_mem_gib > 0 && req.hw.efficiency > 0 && req.hw.efficiency <= 1,
                 UsageError, "plan: --gpu-mem must be positive and --efficiency in (0, 1]");
  if (args.flag_set("calibrate")) {
    parallel::comm::World world;  // the calibration runs the trainer in this process
    PARALLAX_CHECK(world.size() == 1, UsageError,
                   "plan --calibrate runs one process; start it without mpirun or torchrun");
    req.hw = train::planner::calibrate(cfg, req.hw, 20,
                                       args.has("calibrate-batch") ? args.get_int("calibrate-batch") : 0);
  }

  std::vector<train::planner::Row> rows;
  if (args.flag_set("only-config")) {
    auto row = train::planner::predict(cfg, train::planner::configured_layout(cfg, req.hw.gpus), req.hw);
    row.configured = true;
    rows.push_back(row);
  } else {
    rows = train::planner::plan(cfg, req);
  }
  std::fputs(train::planner::render_table(rows, req.hw, static_cast<int>(args.get_int("top"))).c_str(),
             stdout);
  if (args.has("json")) {
    std::string doc = train::planner::render_json(rows, req.hw);
    if (args.flag_set("only-config")) {
      // Every world rank's exact Engine::memory() (what the trainer's "memory" metrics row reports).
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
  return 0;
}

}  // namespace parallax::launch
