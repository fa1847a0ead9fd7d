// The World (world.h): its lifetime. Construction detects the launcher (launch_env.cpp),
// initialises MPI under the start-up deadline, binds the rank's device and creates the store
// (rendezvous.cpp); destruction releases the communicators, meets the other ranks at the exit
// barrier and finalises MPI unless a communicator failed.
#include "comm/world.h"

#include "comm/deadline_call.h"
#include "comm/rendezvous.h"
#include "comm/startup.h"
#include "comm/world_context.h"
#include "core/error.h"
#include "core/log.h"

#include <ATen/Context.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Logging.h>

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>

namespace parallax::comm {
namespace {

World* g_world = nullptr;

}  // namespace

World::World(WorldOptions options) : ctx_(std::make_shared<detail::WorldContext>()) {
  ctx_->uncaught_at_start = std::uncaught_exceptions();
  PARALLAX_CHECK(g_world == nullptr, CommError,
                 "a parallax World already exists in this process (create one, in main)");
#ifndef C10_USE_GFLAGS
  // c10d logs each failed store call as a warning with a C++ stack trace (e.g. when the store's
  // host exits first at teardown). Parallax reports store failures itself, in one line, so c10's
  // threshold is raised to errors unless the user chose one (TORCH_CPP_LOG_LEVEL).
  if (std::getenv("TORCH_CPP_LOG_LEVEL") == nullptr)
    FLAGS_caffe2_log_level = std::max(FLAGS_caffe2_log_level, 2);
#endif
  auto& c = *ctx_;
  c.launch = detect_launch();
  c.init_timeout_s = startup_deadline_s(options.init_timeout_s, options.init_timeout_s);
  c.rank = c.launch.rank;
  c.size = c.launch.world_size;
  if (c.launch.use_mpi) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      {
        // MPI_Init_thread has no deadline of its own: it waits in the launcher's fence for every
        // rank of the job, and one stopped before it would hold this rank forever.
        StartupPhase phase("MPI initialisation (MPI_Init_thread waits for every rank of the job)",
                           c.init_timeout_s, c.launch);
        MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      }
      c.mpi_owned = true;
      if (provided < MPI_THREAD_SERIALIZED) {
        MPI_Finalize();
        throw_error<CommError>(
            "MPI provides thread level {} but Parallax needs at least MPI_THREAD_SERIALIZED",
            provided);
      }
    }
    c.mpi = true;
    int r = 0, n = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (c.launch.launcher != Launcher::kSingle && (r != c.rank || n != c.size)) {
      if (c.mpi_owned) MPI_Finalize();
      throw_error<CommError>("{} says rank {}/{} but MPI says rank {}/{}", c.launch.describe(),
                             c.rank, c.size, r, n);
    }
    c.rank = r;
    c.size = n;
    c.launch.rank = r;
    c.launch.world_size = n;
  }
  core::log::set_rank(c.rank, c.size);

  if (at::hasCUDA()) {
    c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    c.cuda_devices = impl.deviceCount();
    if (c.cuda_devices > 0) {
      c.device = c10::Device(c10::DeviceType::CUDA,
                             static_cast<c10::DeviceIndex>(c.launch.local_rank % c.cuda_devices));
      if (options.set_device) impl.setDevice(*c.device);
    }
  }

  if (options.store) {
    try {
      c.store = detail::make_store(c);
      c.board = std::make_unique<detail::SeqBoard>(c.store, c.rank);
    } catch (const Error& e) {
      if (!c.mpi) {
        if (c.mpi_owned) MPI_Finalize();
        throw;
      }
      // Under MPI the store only serves hang reports (and gloo/NCCL ids, which then use MPI).
      core::log::warn("no out-of-band store, hang reports will not name missing ranks: {}",
                      one_line_what(e));
      c.store.reset();
    }
  }
  g_world = this;
  core::log::debug("world: {}", c.launch.describe());
}

World::~World() {
  auto& c = *ctx_;
  c.shut_down = true;
  c.release_all();
  c.board.reset();
  bool failed = c.failed.load();
  // Destroyed by an exception (this rank leaves with an error): its peers may be waiting for it
  // inside a step and never reach the exit barrier, so it waits there at most kErrorExitS (ranks
  // that failed together still meet and finalise MPI) and past that leaves without finalising, so
  // main prints the error line within that time and the launcher tears the job down.
  constexpr double kErrorExitS = 5;
  const bool unwinding = std::uncaught_exceptions() > c.uncaught_at_start;
  const double exit_timeout_s =
      unwinding ? std::min(kErrorExitS, c.init_timeout_s) : c.init_timeout_s;
  // Exit barrier: rank 0 hosts the store; it must outlive every other rank's use of it. A peer
  // that never arrived may be inside a collective: MPI_Finalize would wait for it.
  if (!failed && c.size > 1 && !detail::exit_barrier(c, exit_timeout_s)) failed = true;
  c.store.reset();
  if (c.mpi_owned) {
    if (failed) {
      core::log::error(
          "a communicator or the exit barrier timed out or failed on this rank: not finalising "
          "MPI (a peer may be stuck inside a collective); the launcher will terminate the job");
    } else {
      MPI_Finalize();
    }
  }
  g_world = nullptr;
}

World& World::current() {
  PARALLAX_CHECK(g_world != nullptr, CommError,
                 "no parallax World in this process: create parallax::comm::World at the "
                 "top of main()");
  return *g_world;
}

bool World::exists() {
  return g_world != nullptr;
}
int World::rank() const {
  return ctx_->rank;
}
int World::size() const {
  return ctx_->size;
}
int World::local_rank() const {
  return ctx_->launch.local_rank;
}
const LaunchInfo& World::launch() const {
  return ctx_->launch;
}
bool World::has_mpi() const {
  return ctx_->mpi;
}
std::optional<c10::Device> World::device() const {
  return ctx_->device;
}
int World::cuda_device_count() const {
  return ctx_->cuda_devices;
}
c10::intrusive_ptr<c10d::Store> World::store() const {
  return ctx_->store;
}
bool World::comm_failed() const {
  return ctx_->failed.load();
}

void World::set_report_dir(const std::string& dir) {
  ctx_->set_report_dir(dir);
}

void World::abort(int code) {
  std::fflush(nullptr);
  if (ctx_->mpi) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace parallax::comm
