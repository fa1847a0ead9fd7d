// The start-up deadline: every wait before a job's first step ends within it, with one line that
// names the phase and the ranks that did not arrive.
//
// Most start-up waits have deadlines of their own (the store connection, the rendezvous
// broadcasts, communicator creation: each takes the deadline as its timeout). MPI_Init_thread has
// none: it waits in the launcher's fence for every rank of the job, so a rank stopped (SIGSTOP),
// swapped out or stuck before it holds every other rank there forever. Such a wait runs inside a
// StartupPhase: a watchdog thread ends the process (one `parallax: error:` line on stderr, exit
// code 1, so `parallax launch` may restart the job) when the phase outlasts the deadline. The
// launcher (mpirun, srun, torchrun, `parallax launch`) then tears the job down.
//
// The deadline (startup_deadline_s) is the smallest of parallel.init_timeout_s (default 300 s),
// parallel.timeout_s and $PARALLAX_STARTUP_TIMEOUT (which `parallax launch --startup-timeout`
// sets for its workers; under mpirun: `mpirun -x PARALLAX_STARTUP_TIMEOUT=60 ...`).
//
// Which ranks did not arrive: before MPI is up nothing but the process table can tell, so the
// report lists this host's other ranks of the job (the processes that the same launcher process
// started, by their launcher's rank variable) that are stopped, dead or not yet started, and says
// how many ranks live on other hosts (not visible from here).
#pragma once

#include "comm/world.h"

#include <memory>
#include <string>
#include <thread>

namespace parallax::comm {

namespace detail {
struct StartupPhaseState;
}

// min(init_timeout_s, timeout_s, $PARALLAX_STARTUP_TIMEOUT). Throws ConfigError naming the
// variable when it is not a positive number.
double startup_deadline_s(double init_timeout_s, double timeout_s);

// "; on this host: rank 0 (pid 4242) is stopped (SIGSTOP?); 2 rank(s) run on other hosts" or ""
// when nothing useful is known. Reads /proc only; never blocks on a peer.
std::string startup_stragglers(const LaunchInfo& launch);

// RAII: while alive, the process ends with one error line if it lives past `deadline_s` (see the
// file comment). Phases do not nest; the destructor disarms the watchdog.
class StartupPhase {
 public:
  StartupPhase(std::string phase, double deadline_s, const LaunchInfo& launch);
  ~StartupPhase();
  StartupPhase(const StartupPhase&) = delete;
  StartupPhase& operator=(const StartupPhase&) = delete;

 private:
  std::shared_ptr<detail::StartupPhaseState> state_;  // shared with the watchdog thread
  std::thread thread_;
};

}  // namespace parallax::comm
