// Internal: the `nccl` backend (CUDA tensors). Compiled only when PARALLAX_WITH_NCCL is defined.
//
// Streams: every communicator owns a high-priority comm stream. An op makes the comm stream wait
// for the caller's current stream (CUDA event), enqueues the NCCL call(s) and any post-processing
// (avg of integers, copies out of padding) on the comm stream, and records an end event.
// Work::wait() polls that event on the host against the op's deadline and then orders the
// caller's current stream after it; wait_stream() only orders the stream. Tensors are recorded on
// the comm stream with the caching allocator, and kept alive until the op completes.
//
// Failure handling: communicators are created non-blocking (ncclConfig_t::blocking = 0), so init,
// split and every enqueue can be polled against a deadline. A watchdog thread per communicator
// marks completed ops in the flight recorder, enforces the deadline of ops nobody waits on
// (wait_stream), and watches ncclCommGetAsyncError; on a timeout or error the communicator writes
// the hang report and calls ncclCommAbort. The NCCL unique id of the world travels through MPI or
// the TCPStore; groups come from ncclCommSplit.
//
// NCCL has no tags: point-to-point messages between two ranks match in issue order. Several
// sends/receives that must proceed together (exchanges) go through batch_isend_irecv, which puts
// them in one ncclGroupStart/End.
//
// Sources, by concern (nccl_internal.h holds the class they share): nccl_bootstrap.cpp (world and
// split communicators), nccl_collectives.cpp, nccl_p2p.cpp, nccl_ring.cpp, nccl_watchdog.cpp
// (watchdog, timeouts, abort, shutdown).
#pragma once

#include "comm/communicator.h"
#include "comm/world_context.h"

#include <memory>

namespace parallax::comm::detail {

// Collective over every rank of the world (init timeout). Needs a CUDA device per rank.
CommPtr make_nccl_world(const std::shared_ptr<WorldContext>& ctx, const CommOptions& options);

}  // namespace parallax::comm::detail
