// The exit codes of the `parallax` binary, shared by every verb and by `parallax launch`, which
// reads its workers' codes to decide whether a restart can help (docs/launch.md lists them).
#pragma once

#include "train/preemption.h"

namespace parallax::launch {

inline constexpr int kExitOk = 0;
// Any other failure (communication, numerics, checkpoint, I/O): a restart may help.
inline constexpr int kExitError = 1;
// Bad command line (UsageError): deterministic, never restarted.
inline constexpr int kExitUsage = 2;
// A deterministic failure: ConfigError, LayoutError or DataError. The same command fails the same
// way again, so `parallax launch` never restarts it (pytorch#60910).
inline constexpr int kExitDeterministic = 3;
// `parallax launch` only: a worker failed after the restart budget (--max-restarts) was spent.
inline constexpr int kExitRestartsExhausted = 4;
// Stopped for preemption (SIGTERM / SIGINT) after saving a checkpoint; 128 + SIGTERM.
inline constexpr int kExitPreempted = train::kExitPreempted;

}  // namespace parallax::launch
