#!/usr/bin/env bash
# The README's test command: installs what is missing, builds, runs every test, ends with ctest's
# summary. Pass ctest arguments through, e.g. `scripts/test.sh -L mpi` or `-R Config`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
BUILD=${PARALLAX_BUILD_DIR:-build}
cd "$BUILD"
# One more job than cores: many end-to-end tests spend much of their time waiting (deadlines,
# stopped ranks, process start-up), and the heavy multi-rank ones hold a RESOURCE_LOCK
# (tests/train/CMakeLists.txt), so a third test fills what they leave idle.
ctest --output-on-failure --timeout 600 -j "${PARALLAX_TEST_JOBS:-$(($(nproc) + 1))}" "$@"
