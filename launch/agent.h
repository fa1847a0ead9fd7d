// The supervisor behind `parallax launch` (docs/launch.md): one agent per node spawns that node's
// workers with torchrun's environment, hosts (node 0) or joins the rendezvous store, watches the
// workers, tears every node's group down when one worker fails, and restarts all nodes together
// within a global budget, or forwards a preemption signal and waits for the workers' checkpoint.
//
// Store (c10d::TCPStore, hosted by node 0's agent, so a dead or stopped worker never takes it
// down). The agents' keys live under `launch/`; the workers see the same store through the prefix
// /worker/attempt_<restart> (comm/rendezvous.cpp), so every attempt's keys are apart:
//   launch/join/<r>      counter: nodes ready to spawn attempt r (a barrier with a deadline)
//   launch/failed/<r>    first failure of attempt r, set once (compareSet): "<kind>|<node>|<text>"
//                        kind: fail, deterministic, preempt
//   launch/restarts      the global restart counter: incremented once per failed attempt, by the
//                        agent whose failure was recorded first
//   launch/done/<r>      counter: nodes whose workers all exited 0
//   launch/bye           counter: agents that are leaving (node 0 waits for it before it exits)
//
// Every wait has a deadline (rendezvous, the workers' grace period, preemption, the exit barrier).
// Not thread-safe; one agent per process. Errors are thrown as parallax::Error naming the node.
#pragma once

#include <string>
#include <vector>

namespace parallax::launch {

struct AgentOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0 (standalone): node 0 picks a free port
  int max_restarts = 0;
  double monitor_interval_s = 0.2;
  double grace_period_s = 10;      // SIGTERM -> SIGKILL when tearing a failed group down
  double preempt_timeout_s = 600;  // forwarded SIGTERM -> SIGKILL: time for the checkpoint
  double rdzv_timeout_s = 300;     // nodes joining an attempt; nodes finishing together
  double startup_timeout_s = 0;    // > 0: the workers' PARALLAX_STARTUP_TIMEOUT (start-up deadline)
  std::string log_dir;             // <run dir>/logs: rank_<N>.log per worker
  std::string exe;                 // the worker binary (this binary)
  std::vector<std::string> worker_args;  // after the binary: e.g. train --config X ...
};

// Runs the job to its end; returns the launcher's exit code (launch/exit_codes.h): 0, or
// kExitRestartsExhausted, kExitDeterministic, kExitPreempted. Throws Error (exit 1) when the
// store cannot be hosted or reached, or a worker cannot be spawned.
int run_agent(const AgentOptions& options);

// This binary's path (/proc/self/exe): what the agent starts as its workers (AgentOptions::exe).
std::string self_exe();

// What this node can run workers on, for the cap on --nproc-per-node (docs/launch.md): the CPU
// cores this process may run on (its affinity mask: taskset, cgroup cpusets), at least 1, and the
// CUDA devices it sees (CUDA_VISIBLE_DEVICES applies; 0 without CUDA).
int usable_cpu_cores();
int visible_cuda_devices();

}  // namespace parallax::launch
