// Internal: the `gloo` backend (CPU tensors) on c10d's ProcessGroupGloo from LibTorch, for jobs
// that were not launched by MPI (torchrun style). Rendezvous through the World's TCPStore (a
// PrefixStore per group); groups from split() are new ProcessGroupGloo instances over their
// members. Only this backend's .cpp sees gloo's headers. Compiled when PARALLAX_WITH_GLOO is
// defined.
#pragma once

#include "comm/communicator.h"
#include "comm/world_context.h"

#include <memory>

namespace parallax::comm::detail {

// Collective over every rank of the world (init timeout).
CommPtr make_gloo_world(const std::shared_ptr<WorldContext>& ctx, const CommOptions& options);

}  // namespace parallax::comm::detail
