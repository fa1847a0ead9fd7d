#!/usr/bin/env bash
# Configures and builds Parallax into ${PARALLAX_BUILD_DIR:-build} (Release, Ninja when present).
# Extra arguments go to CMake's configure step (e.g. -DONNX_ROOT=... -DPARALLAX_PCH=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${PARALLAX_BUILD_DIR:-build}
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-Release} "$@"
elif (($#)); then
  cmake -S . -B "$BUILD" "$@"
fi
start=$(date +%s)
cmake --build "$BUILD" -j "${PARALLAX_JOBS:-$(nproc)}"
echo "[build] done in $(( $(date +%s) - start ))s: $BUILD/bin/parallax"
