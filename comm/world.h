// The process world: how this process was launched, the MPI runtime (when MPI launched it), the
// out-of-band c10d TCPStore every communicator uses for rendezvous and hang reports, and the
// device of this rank.
//
// Launchers (detect_launch, first match wins):
//   - OpenMPI mpirun:   OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}            -> MPI
//   - torchrun style:   RANK WORLD_SIZE [LOCAL_RANK LOCAL_WORLD_SIZE] MASTER_ADDR MASTER_PORT
//                       (also `parallax launch`)                                     -> TCPStore
//   - Slurm srun:       SLURM_PROCID SLURM_NTASKS SLURM_LOCALID [SLURM_NTASKS_PER_NODE];
//                       MPI when srun provides PMI/PMIx (PMIX_RANK or PMI_RANK), else
//                       TCPStore at MASTER_ADDR:MASTER_PORT
//   - otherwise a single process (MPI is still initialised, as a singleton).
//
// Rendezvous: under MPI, rank 0 hosts a TCPStore on an ephemeral port (or $PARALLAX_STORE_PORT)
// and sends its address to the others through MPI_Bcast; the address is $PARALLAX_STORE_ADDR, else
// $MASTER_ADDR, else rank 0's host name (127.0.0.1 for ranks on rank 0's host). Without MPI, rank 0
// hosts the TCPStore at MASTER_ADDR:MASTER_PORT (or, under torchrun's agent store,
// TORCHELASTIC_USE_AGENT_STORE=True, every rank connects to the agent's, through the prefix
// /worker/attempt_<TORCHELASTIC_RESTART_COUNT> as torchrun's workers do, so each restart's keys are
// apart; `parallax launch` is such an agent). No other sockets exist.
//
// Lifetime: exactly one World per process, created first in main() and destroyed last; every
// communicator must be destroyed before it (the World frees what is left and logs it). The World
// is the process-wide "current world" (World::current()), the only global besides the logger.
// After a communicator timed out or failed, ~World does not call MPI_Finalize (it would wait for
// the stuck peer forever): the process exits with its own code and mpirun tears the job down. A
// program that wants to choose the job's exit code after such a failure calls World::abort(code).
// Not thread-safe to construct or destroy; the accessors are.
#pragma once

#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace c10d {
class Store;
}

namespace parallax::comm {

namespace detail {
class WorldContext;
}

enum class Launcher { kSingle, kOpenMpi, kTorchrun, kSlurm };
const char* to_string(Launcher launcher);

struct LaunchInfo {
  Launcher launcher = Launcher::kSingle;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  bool use_mpi = true;      // rendezvous through MPI (else the TCPStore)
  std::string master_addr;  // torchrun / Slurm without MPI
  int master_port = 0;
  bool agent_store = false;  // torchrun's agent hosts the store (every rank is a client)

  std::string describe() const;  // "torchrun: rank 1/2, local 1/2, store 127.0.0.1:29500"
};

// Reads the launcher's variables through `getenv` (std::getenv by default; tests pass a map).
// Throws CommError naming the variable and its value when a variable is malformed or missing
// (e.g. WORLD_SIZE=2 without MASTER_ADDR).
using GetEnv = std::function<const char*(const char*)>;
LaunchInfo detect_launch(const GetEnv& getenv = nullptr);

struct WorldOptions {
  double init_timeout_s = 300;  // store rendezvous
  bool set_device = true;       // set the current CUDA device to local_rank % device count
  bool store = true;  // host/connect the out-of-band TCPStore (hang reports, gloo, NCCL id)
};

class World {
 public:
  explicit World(WorldOptions options = {});
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  // The live World; throws CommError if none exists.
  static World& current();
  static bool exists();

  int rank() const;
  int size() const;
  int local_rank() const;
  const LaunchInfo& launch() const;
  bool has_mpi() const;  // MPI was initialised by (or before) this World
  // CUDA device of this rank (local_rank % device count) when the node has GPUs.
  std::optional<c10::Device> device() const;
  int cuda_device_count() const;
  // The out-of-band store (nullptr if disabled or if it could not be created under MPI).
  c10::intrusive_ptr<c10d::Store> store() const;
  // True once any communicator of this process timed out or failed.
  bool comm_failed() const;

  // Where communicators write their failure reports (flight recorder JSON): the run directory.
  // $PARALLAX_FLIGHT_DIR, when set, takes precedence; unset, the working directory.
  void set_report_dir(const std::string& dir);

  // Tears the whole job down: MPI_Abort(MPI_COMM_WORLD, code) under MPI, else flushes and _Exit.
  // The documented way out after a TimeoutError when the caller wants a specific exit code.
  [[noreturn]] void abort(int code);

  const std::shared_ptr<detail::WorldContext>& context() const { return ctx_; }

 private:
  std::shared_ptr<detail::WorldContext> ctx_;
};

}  // namespace parallax::comm
