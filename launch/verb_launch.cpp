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
#include <limits>
#include <optional>

namespace fs = std::filesystem;

namespace parallax::launch {
namespace {

// Workers on one node, whatever --allow-oversubscribe says: each is a LibTorch process of about
// 65 MB resident before any work (347 workers held 22.5 GB, issue 35), so 1024 are ~65 GB.
constexpr int64_t kMaxWorkersPerNode = 1024;
// Ranks in the job (--nproc-per-node x --nnodes): the world size the workers size per-rank tables
// by, and the store's join counters count to; far beyond any cluster built.
constexpr int64_t kMaxWorld = 1 << 20;
// Whole-job restarts: each respawns every worker of every node; a job that fails more often is
// broken, not unlucky.
constexpr int64_t kMaxRestarts = 1000;
// Every wait the launcher has (rendezvous, grace period, preemption) is bounded by its flag; a
// deadline beyond a day is a hang, not a wait.
constexpr double kMaxWaitS = 86400;

// The config of a `train` command, loaded as `parallax train` loads it. Throws ConfigError as the
// workers would (then nothing is started: exit 3, no restart).
train::RunConfig train_config(const std::vector<std::string>& cmd) {
  Args a("train", "");
  a.option("config", "FILE", "").flag("print-config", "").flag("help-config", "").overrides("");
  std::vector<std::string> rest(cmd.begin() + 1, cmd.end());
  a.parse(rest);
  PARALLAX_CHECK(a.has("config"), UsageError,
                 "launch: the worker command 'train' needs --config FILE; see 'parallax train "
                 "--help'");
  return train::load_run_config(a.get("config"), a.override_args());
}

// The cap on --nproc-per-node (docs/launch.md): one worker per GPU on a node with GPUs (unless the
// worker is a `train` with train.device=cpu), else one per CPU core; --allow-oversubscribe lifts
// it up to kMaxWorkersPerNode.
void check_workers(int64_t nproc, bool oversubscribe, bool cpu_worker) {
  const int gpus = cpu_worker ? 0 : visible_cuda_devices();
  const int cores = usable_cpu_cores();
  const std::string what =
      gpus > 0 ? fmt::format("{} GPU(s)", gpus) : fmt::format("{} CPU core(s)", cores);
  PARALLAX_CHECK(nproc <= kMaxWorkersPerNode, UsageError,
                 "launch: --nproc-per-node {} is more than {} workers per node, the limit even "
                 "with --allow-oversubscribe (this node has {}; each worker is a process of "
                 "~65 MB before any work)",
                 nproc, kMaxWorkersPerNode, what);
  if (oversubscribe) return;
  PARALLAX_CHECK(
      nproc <= (gpus > 0 ? gpus : cores), UsageError,
      "launch: --nproc-per-node {} is more than this node's {} ({}); pass "
      "--allow-oversubscribe to start them anyway",
      nproc, what,
      gpus > 0 ? "one worker per GPU: more would share a GPU" : "one CPU worker per core");
}

// The launcher's own options (before `--`), with the help text `--help` prints.
Args launch_args() {
  Args args("launch",
            "Run --nproc-per-node workers of a parallax command on this node, torchrun style: "
            "restart every node together when a worker fails (within a global budget), forward "
            "SIGTERM/SIGINT for a checkpoint and a clean stop. The workers run this binary.");
  args.option("nproc-per-node", "N", "workers on this node (one GPU each on GPU nodes)", "1")
      .option("nnodes", "M", "nodes in the job", "1")
      .option("node-rank", "R", "this node's rank, 0..M-1 (node 0 hosts the rendezvous store)", "0")
      .option("master", "HOST:PORT", "address of node 0's store (node 0 listens on PORT)")
      .flag("standalone", "one node, the store on 127.0.0.1 at a free port")
      .flag("allow-oversubscribe",
            "start more workers than this node has GPUs (CPU workers: cores); at most 1024")
      .option("max-restarts", "K", "restarts of the whole job (all nodes) before giving up", "0")
      .option("monitor-interval", "S", "seconds between checks of the workers and the store", "0.2")
      .option("grace-period", "S", "a failed group's workers get SIGTERM, then SIGKILL after S s",
              "10")
      .option("preempt-timeout", "S",
              "on SIGTERM/SIGINT, seconds the workers get to checkpoint before SIGKILL", "600")
      .option("rdzv-timeout", "S", "seconds for every node to join (each attempt, and the end)",
              "300")
      .option("startup-timeout", "S",
              "the workers' start-up deadline: every wait before the first step (MPI init, "
              "store, rendezvous, communicator creation) ends within S s with one line naming "
              "the phase (sets PARALLAX_STARTUP_TIMEOUT; the smallest of it, "
              "parallel.init_timeout_s and parallel.timeout_s holds)")
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
  return args;
}

// The rendezvous store's address into `o` (--standalone, --master HOST:PORT, or one node on a free
// port of 127.0.0.1). Throws UsageError for a malformed or contradictory choice.
void read_store_address(const Args& args, AgentOptions& o) {
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
}

}  // namespace

int verb_launch(const std::vector<std::string>& argv) {
  Args args = launch_args();
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
  // Bounded by check_workers() below, which names this node's GPUs or cores.
  o.nproc_per_node =
      static_cast<int>(args.get_int("nproc-per-node", 1, std::numeric_limits<int>::max()));
  o.nnodes = static_cast<int>(args.get_int("nnodes", 1, kMaxWorld));
  o.node_rank = static_cast<int>(args.get_int("node-rank", 0, kMaxWorld - 1));
  o.max_restarts = static_cast<int>(args.get_int(
      "max-restarts", 0, kMaxRestarts,
      "each restart respawns every worker of every node; a job failing that often is broken"));
  PARALLAX_CHECK(o.node_rank < o.nnodes, UsageError,
                 "launch: --node-rank {} is outside the {} node(s) of --nnodes", o.node_rank,
                 o.nnodes);
  PARALLAX_CHECK(static_cast<int64_t>(o.nproc_per_node) * o.nnodes <= kMaxWorld, UsageError,
                 "launch: --nproc-per-node {} x --nnodes {} is more than {} ranks in all",
                 o.nproc_per_node, o.nnodes, kMaxWorld);
  const std::string day = "a deadline beyond a day is a hang, not a wait";
  o.monitor_interval_s = args.get_double("monitor-interval", 0, 60, true,
                                         "the launcher checks its workers this often");
  o.grace_period_s = args.get_double("grace-period", 0, kMaxWaitS, false, day);
  o.preempt_timeout_s = args.get_double("preempt-timeout", 0, kMaxWaitS, true, day);
  o.rdzv_timeout_s = args.get_double("rdzv-timeout", 0, kMaxWaitS, true, day);
  if (args.has("startup-timeout"))
    o.startup_timeout_s = args.get_double("startup-timeout", 0, kMaxWaitS, true, day);
  read_store_address(args, o);

  // A restart must continue from the last checkpoint: `train` gets train.resume=auto unless the
  // command sets train.resume itself.
  if (cmd[0] == "train") {
    bool has_resume = false;
    for (const auto& a : cmd) has_resume = has_resume || core::starts_with(a, "train.resume=");
    if (!has_resume) cmd.push_back("train.resume=auto");
  }
  std::optional<train::RunConfig> cfg;
  if (cmd[0] == "train") cfg = train_config(cmd);
  check_workers(o.nproc_per_node, args.flag_set("allow-oversubscribe"),
                cfg && cfg->train.device == "cpu");
  if (args.has("log-dir")) {
    o.log_dir = args.get("log-dir");
  } else if (cfg) {
    o.log_dir = (fs::path(cfg->experiment.output_dir) / cfg->experiment.name / "logs").string();
  } else {
    o.log_dir = "logs";
  }
  o.exe = self_exe();
  o.worker_args = cmd;
  return run_agent(o);
}

}  // namespace parallax::launch
