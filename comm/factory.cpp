#include "comm/factory.h"

#include "comm/mpi_communicator.h"
#include "comm/world_context.h"
#include "core/error.h"

#ifdef PARALLAX_WITH_GLOO
#include "comm/gloo_communicator.h"
#endif
#ifdef PARALLAX_WITH_NCCL
#include "comm/nccl_communicator.h"
#endif

#include <fmt/ranges.h>

namespace parallax::comm {

std::vector<std::string> compiled_backends() {
  std::vector<std::string> out = {"mpi"};
#ifdef PARALLAX_WITH_GLOO
  out.push_back("gloo");
#endif
#ifdef PARALLAX_WITH_NCCL
  out.push_back("nccl");
#endif
  return out;
}

bool backend_compiled(const std::string& name) {
  for (const auto& b : compiled_backends()) {
    if (b == name) return true;
  }
  return false;
}

std::string resolve_backend(const std::string& name, const World& world) {
  const auto compiled = compiled_backends();
  if (name == "auto") {
    if (backend_compiled("nccl") && world.device().has_value()) return "nccl";
    if (world.has_mpi()) return "mpi";
    if (backend_compiled("gloo")) return "gloo";
    throw_error<ConfigError>(
        "parallel.backend=auto: no CPU backend for this job: it was started by {} (no MPI) and "
        "this build has no gloo "
        "(gloo's headers were not found at configure time; install libgloo-dev and reconfigure), "
        "so launch it with "
        "mpirun, or run on GPUs with nccl (compiled backends: {})",
        world.launch().describe(), fmt::join(compiled, ", "));
  }
  if (name != "mpi" && name != "gloo" && name != "nccl") {
    throw_error<ConfigError>("parallel.backend: unknown backend '{}' (use auto|mpi|gloo|nccl)",
                             name);
  }
  if (!backend_compiled(name)) {
    throw_error<ConfigError>(
        "parallel.backend={}: this build has no {} backend (compiled backends: {}){}", name, name,
        fmt::join(compiled, ", "),
        name == "gloo" ? "; install gloo's headers (libgloo-dev) and reconfigure"
                       : "; build against a CUDA LibTorch with NCCL");
  }
  if (name == "mpi" && !world.has_mpi()) {
    throw_error<ConfigError>(
        "parallel.backend=mpi needs an MPI launch (mpirun, or srun with PMI), but this job was "
        "started by {}; use gloo for CPU tensors or nccl for GPUs",
        world.launch().describe());
  }
  if (name == "nccl" && !world.device().has_value()) {
    throw_error<ConfigError>("parallel.backend=nccl needs CUDA GPUs, but world rank {} sees none",
                             world.rank());
  }
  return name;
}

CommPtr make_world_communicator(World& world, const std::string& backend,
                                const CommOptions& options) {
  const std::string b = resolve_backend(backend, world);
  const auto& ctx = world.context();
  if (b == "mpi") return detail::MpiCommunicator::create_world(ctx, options);
#ifdef PARALLAX_WITH_GLOO
  if (b == "gloo") return detail::make_gloo_world(ctx, options);
#endif
#ifdef PARALLAX_WITH_NCCL
  if (b == "nccl") return detail::make_nccl_world(ctx, options);
#endif
  throw_error<ConfigError>("parallel.backend: backend '{}' is not available", b);
}

CommPtr make_world_communicator(const std::string& backend, const CommOptions& options) {
  return make_world_communicator(World::current(), backend, options);
}

CommOptions make_comm_options(double timeout_s, double init_timeout_s, double checkpoint_timeout_s,
                              bool debug_collectives, int flight_recorder_size,
                              const std::string& allreduce, int64_t ring_chunk_bytes) {
  PARALLAX_CHECK(timeout_s > 0, ConfigError, "parallel.timeout_s: must be positive, got {}",
                 timeout_s);
  PARALLAX_CHECK(init_timeout_s > 0, ConfigError,
                 "parallel.init_timeout_s: must be positive, got {}", init_timeout_s);
  PARALLAX_CHECK(checkpoint_timeout_s > 0, ConfigError,
                 "parallel.checkpoint_timeout_s: must be positive, got {}", checkpoint_timeout_s);
  PARALLAX_CHECK(flight_recorder_size >= 1, ConfigError,
                 "parallel.flight_recorder_size: must be at least 1, got {}", flight_recorder_size);
  PARALLAX_CHECK(ring_chunk_bytes >= 0, ConfigError,
                 "ring_chunk_bytes: must be positive (or 0 for the backend's default), got {}",
                 ring_chunk_bytes);
  CommOptions o;
  o.timeout_s = timeout_s;
  o.init_timeout_s = init_timeout_s;
  o.checkpoint_timeout_s = checkpoint_timeout_s;
  o.debug_collectives = debug_collectives;
  o.flight_recorder_size = flight_recorder_size;
  o.allreduce_algo = parse_allreduce_algo(allreduce);
  o.ring_chunk_bytes = ring_chunk_bytes;
  return o;
}

}  // namespace parallax::comm
