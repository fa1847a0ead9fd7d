// Internal: how the ranks of a World meet. make_store() creates the out-of-band TCPStore (hosted
// by rank 0, or by torchrun's / `parallax launch`'s agent; under MPI its address travels by
// MPI_Bcast), and exit_barrier() holds every rank at shutdown until all have arrived, so that
// rank 0, the store's host, is the last to stop using it. Every wait has a deadline and names
// the ranks that never arrived where it can. Not part of the public API.
#pragma once

#include "comm/world_context.h"

namespace parallax::comm::detail {

// The World's store for `ctx` (launch, rank, size, mpi and init_timeout_s set). Throws CommError
// when it cannot be hosted or reached, TimeoutError when rank 0's address does not arrive in time.
c10::intrusive_ptr<c10d::Store> make_store(WorldContext& ctx);

// Waits within `timeout_s` until every rank has arrived (MPI_Ibarrier under MPI, else two counter
// phases in the store). Returns false, after a one-line warning, when it failed or timed out: a
// peer that never arrived may be inside a collective, so MPI must not be finalised.
bool exit_barrier(const WorldContext& ctx, double timeout_s);

}  // namespace parallax::comm::detail
