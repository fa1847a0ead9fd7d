// `parallax launch`: a torchrun-style supervisor (launch/agent.h, docs/launch.md). Parses the
// launcher's options (before `--`) and the worker command (after it), resolves the log folder from
// the worker's train config, and runs the agent of this node.
#include "core/error.h"
#include "core/strings.h"
#include "launch/agent.h"
#include "launch/args.h"
#include "launch/verbs.h"
#include "train/run_config.h"

#include <fmt/format.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <filesystem>

namespace fs = std::filesystem;

namespace parallax::launch {
namespace {

// The run directory of a `train` command: its config loaded as `parallax train` loads it.
// Throws ConfigError as the workers would (then nothing is started: exit 3, no restart).
fs::path train_run_dir(const std::vector<std::string>& cmd) {
  Args a("train", "");
  a.option("config", "FILE", "").flag("print-config", "").flag("help-config", "").overrides("");
  std::vector<std::string> rest(cmd.begin() + 1, cmd.end());
  a.parse(rest);
  PARALLAX_CHECK(a.has("config"), UsageError,
                 "launch: the worker command 'train' needs --config FILE; see 'parallax train "
                 "--help'");
  train::RunConfig cfg = train::load_run_config(a.get("config"), a.override_args());
  return fs::path(cfg.experiment.output_dir) / cfg.experiment.name;
}

}  // namespace

int verb_launch(const std::vector<std::string>& argv) {
  Args args("launch",
            "Run --nproc-per-node workers of a parallax command on this node, torchrun style: "
            "restart every node together when a worker fails (within a global budget), forward "
            "SIGTERM/SIGINT for a checkpoint and a clean stop. The workers run this binary.");
  args.option("nproc-per-node", "N", "workers on this node (one GPU each on GPU nodes)", "1")
      .option("nnodes", "M", "nodes in the job", "1")
      .option("node-rank", "R", "this node's rank, 0..M-1 (node 0 hosts the rendezvous store)", "0")
      .option("master", "HOST:PORT", "address of node 0's store (node 0 listens on PORT)")
      .flag("standalone", "one node, the store on 127.0.0.1 at a free port")
      .option("max-restarts", "K", "restarts of the whole job (all nodes) before giving up", "0")
      .option("monitor-interval", "S", "seconds between checks of the workers and the store", "0.2")
      .option("grace-period", "S", "a failed group's workers get SIGTERM, then SIGKILL after S s",
              "10")
      .option("preempt-timeout", "S",
              "on SIGTERM/SIGINT, seconds the workers get to checkpoint before SIGKILL", "600")
      .option("rdzv-timeout", "S", "seconds for every node to join (each attempt, and the end)",
              "300")
      .option("log-dir", "DIR",
              "per-rank logs rank_<N>.log (default: <run dir>/logs for train, else ./logs)")
      .epilog(
          "usage: parallax launch [options] -- train --config FILE [overrides]\n"
          "A `train` command without a train.resume override gets train.resume=auto, so that a\n"
          "restart continues from the last checkpoint.\n"
          "exit codes: 0 success, 1 launcher error, 2 usage, 3 deterministic worker failure\n"
          "(config, layout or data error: not restarted), 4 restart budget exhausted,\n"
          "143 preempted (the workers saved a checkpoint and stopped).\n"
          "examples:\n"
          "  parallax launch --nproc-per-node 2 --standalone -- train --config "
          "configs/bev_tiny.yaml\n"
          "  parallax launch --nproc-per-node 8 --nnodes 2 --node-rank 0 --master node0:29500 \\\n"
          "      --max-restarts 3 -- train --config configs/bev_tiny.yaml");
  // Everything after `--` is the worker command.
  std::vector<std::string> mine, cmd;
  bool after = false;
  for (const auto& a : argv) {
    if (!after && a == "--") {
      after = true;
      continue;
    }
    (after ? cmd : mine).push_back(a);
  }
  args.parse(mine);
  if (args.help_requested()) {
    std::fputs(args.help_text().c_str(), stdout);
    return 0;
  }
  // `-- parallax train ...` and `-- /path/to/parallax train ...`: the workers run this binary.
  if (!cmd.empty() && fs::path(cmd[0]).filename() == "parallax") cmd.erase(cmd.begin());
  PARALLAX_CHECK(!cmd.empty(), UsageError,
                 "launch: no worker command; usage: parallax launch [options] -- train --config "
                 "FILE [overrides]");
  PARALLAX_CHECK(cmd[0] != "launch", UsageError, "launch: the worker command cannot be 'launch'");

  AgentOptions o;
  auto positive = [&](const char* name, int64_t min) {
    const int64_t v = args.get_int(name);
    PARALLAX_CHECK(v >= min && v <= 1 << 20, UsageError, "launch: --{} must be at least {}, got {}",
                   name, min, v);
    return static_cast<int>(v);
  };
  o.nproc_per_node = positive("nproc-per-node", 1);
  o.nnodes = positive("nnodes", 1);
  o.node_rank = positive("node-rank", 0);
  o.max_restarts = positive("max-restarts", 0);
  PARALLAX_CHECK(o.node_rank < o.nnodes, UsageError,
                 "launch: --node-rank {} is outside the {} node(s) of --nnodes", o.node_rank,
                 o.nnodes);
  o.monitor_interval_s = args.get_double("monitor-interval");
  o.grace_period_s = args.get_double("grace-period");
  o.preempt_timeout_s = args.get_double("preempt-timeout");
  o.rdzv_timeout_s = args.get_double("rdzv-timeout");
  PARALLAX_CHECK(o.monitor_interval_s > 0 && o.grace_period_s >= 0 && o.preempt_timeout_s > 0 &&
                     o.rdzv_timeout_s > 0,
                 UsageError,
                 "launch: --monitor-interval, --preempt-timeout and --rdzv-timeout must be > 0 and "
                 "--grace-period >= 0");
  if (args.flag_set("standalone")) {
    PARALLAX_CHECK(o.nnodes == 1 && !args.has("master"), UsageError,
                   "launch: --standalone is one node with its own store: it excludes --nnodes > 1 "
                   "and --master");
    o.master_addr = "127.0.0.1";
    o.master_port = 0;
  } else if (args.has("master")) {
    const std::string m = args.get("master");
    const auto colon = m.rfind(':');
    PARALLAX_CHECK(colon != std::string::npos && colon > 0, UsageError,
                   "launch: --master '{}' is not HOST:PORT", m);
    o.master_addr = m.substr(0, colon);
    char* end = nullptr;
    const long port = std::strtol(m.c_str() + colon + 1, &end, 10);
    PARALLAX_CHECK(*end == '\0' && port > 0 && port < 65536, UsageError,
                   "launch: --master '{}': the port is not a TCP port", m);
    o.master_port = static_cast<int>(port);
  } else {
    PARALLAX_CHECK(o.nnodes == 1, UsageError,
                   "launch: --nnodes {} needs --master HOST:PORT (node 0's address)", o.nnodes);
    o.master_addr = "127.0.0.1";
    o.master_port = 0;  // one node: any free port
  }

  // A restart must continue from the last checkpoint: `train` gets train.resume=auto unless the
  // command sets train.resume itself.
  if (cmd[0] == "train") {
    bool has_resume = false;
    for (const auto& a : cmd) has_resume = has_resume || core::starts_with(a, "train.resume=");
    if (!has_resume) cmd.push_back("train.resume=auto");
  }
  if (args.has("log-dir")) {
    o.log_dir = args.get("log-dir");
  } else if (cmd[0] == "train") {
    o.log_dir = (train_run_dir(cmd) / "logs").string();
  } else {
    o.log_dir = "logs";
  }
  o.exe = self_exe();
  o.worker_args = cmd;
  return run_agent(o);
}

}  // namespace parallax::launch
