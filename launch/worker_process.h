// The worker processes of one `parallax launch` node (launch/agent.h): the environment a worker
// gets (this process's, the launcher's own variables replaced by torchrun's), its start (fork +
// execve with its log as stdout and stderr, in its own process group, killed with the launcher),
// and how its end and its log read in the launcher's messages.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace parallax::launch {

// This process's environment ("K=V") without the variables a launcher sets (RANK, MASTER_ADDR,
// TORCHELASTIC_*, OMPI_COMM_WORLD_*, ...), so that a worker never sees an outer launcher's. With
// `startup_timeout_s` > 0, PARALLAX_STARTUP_TIMEOUT is replaced by it.
std::vector<std::string> inherited_worker_env(double startup_timeout_s);

// Where a worker sits in the job, as torchrun tells its workers.
struct WorkerPlace {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
  int nproc_per_node = 1;
  int node_rank = 0;
  int nnodes = 1;
  std::string master_addr;
  int master_port = 0;
  int attempt = 0;  // TORCHELASTIC_RESTART_COUNT
  int max_restarts = 0;
};

// torchrun's variables ("K=V") for the worker at `place`, with the agent's store
// (TORCHELASTIC_USE_AGENT_STORE=True).
std::vector<std::string> torchrun_env(const WorkerPlace& place);

// Starts `argv` (argv[0] is the binary, run as `exe`) with environment `env`, stdout and stderr
// appended to `log`, stdin from /dev/null, in a process group of its own and with
// PR_SET_PDEATHSIG, so that a launcher killed outright takes its workers with it. Returns the
// pid, or -1 with errno set when fork failed. A child that cannot open its log exits 126, one
// whose exec fails 127.
pid_t start_worker(const std::string& exe, std::vector<std::string> argv,
                   std::vector<std::string> env, const std::string& log);

// "exited with code 3", "died on signal 9 (SIGKILL)": a waitpid status in words.
std::string describe_status(int status);

// The last `n` lines of `file` (at most 64 KiB read), each prefixed "  | " for the console.
std::string tail_lines(const std::string& file, int n);

}  // namespace parallax::launch
