// Agreement on the outcome of a step that each rank runs on its own (reading its part of a
// checkpoint, opening the run directory): the ranks exchange their outcome before any of them
// issues another collective, so a rank that failed alone cannot leave the others waiting in the
// next one.
#pragma once

#include "comm/communicator.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace parallax::comm {

// Runs `body` on this rank, then one all-gather over `comm` (with the communicator's timeout)
// carries every member's outcome: whether `body` threw, of which parallax::Error kind, its message
// (clipped to about 1.9 KB), and the int64 token `body` returned. On `device` when `comm` is a
// device communicator (NCCL), on the CPU otherwise. `body` must issue no collective on `comm`.
//
// If any member failed, every member throws the same error, of the first failing member's kind
// (ConfigError, LayoutError, DataError, IoError, CheckpointError, NumericsError, TimeoutError,
// CommError, else Error): "<what> failed on world rank R (of N)[ (and on world rank(s) ...)]:
// <its message>", or that message as it is when `what` is empty. Otherwise returns the members'
// tokens, in member order (the caller checks that they agree, e.g. on the step a resume reads).
// A single-member group runs `body` and returns its token without communicating.
std::vector<int64_t> agree_on(Communicator& comm, const c10::Device& device,
                              const std::string& what, const std::function<int64_t()>& body);

}  // namespace parallax::comm
