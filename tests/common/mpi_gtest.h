// Support for GoogleTest binaries that run under mpirun: rank-aware output and the GPU skip rule.
#pragma once

#include "comm/world.h"

namespace parallax::testing {

// On ranks other than 0: replaces GoogleTest's printer by one that prints only failures, prefixed
// with the rank (rank 0 keeps the usual output).
void install_rank_printer(int rank);

// True, after printing the `PARALLAX_SKIP` line ctest treats as a skip, when
// PARALLAX_TEST_BACKEND=nccl and this node has fewer GPUs than ranks.
bool skip_without_gpus(const comm::World& world);

}  // namespace parallax::testing
