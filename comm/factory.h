// Creating communicators: the world communicator of a backend, the backend `auto` resolves to, and
// CommOptions from the `parallel` config section's plain values (comm never reads config).
//
// Backends: "mpi" (CPU tensors; needs an MPI launch or a single process), "gloo" (CPU tensors;
// c10d's ProcessGroupGloo over the World's TCPStore; any launch; compiled when gloo's headers were
// found), "nccl" (CUDA tensors; compiled when LibTorch has CUDA and NCCL was found). "auto": nccl
// when it is compiled in and this node has GPUs, else mpi when MPI is initialised (an MPI launch or
// a single process), else gloo. Errors: ConfigError for an unknown or unavailable backend, naming
// it and what is available; TimeoutError when a rank does not arrive within init_timeout_s.
#pragma once

#include "comm/communicator.h"
#include "comm/world.h"

#include <string>
#include <vector>

namespace parallax::comm {

// Backends compiled into this build, e.g. {"mpi", "gloo"}.
std::vector<std::string> compiled_backends();
bool backend_compiled(const std::string& name);

// "auto" -> a concrete backend for `world`; a concrete name is checked for availability.
std::string resolve_backend(const std::string& name, const World& world);

// Collective over every rank of the world (all ranks must call it, in the same order).
CommPtr make_world_communicator(World& world, const std::string& backend,
                                const CommOptions& options = {});
// Same, on World::current().
CommPtr make_world_communicator(const std::string& backend, const CommOptions& options = {});

// CommOptions from the `parallel` section's values. `allreduce` is "native" or "ring"
// (ConfigError otherwise); timeouts must be positive and flight_recorder_size at least 1.
CommOptions make_comm_options(double timeout_s, double init_timeout_s, double checkpoint_timeout_s,
                              bool debug_collectives, int flight_recorder_size,
                              const std::string& allreduce,
                              int64_t ring_chunk_bytes = CommOptions{}.ring_chunk_bytes);

}  // namespace parallax::comm
