#!/usr/bin/env bash
# Configures and builds Parallax into ${PARALLAX_BUILD_DIR:-build} (Release, Ninja when present).
# Idempotent: configures once (again only when configure arguments are given), then builds what
# is out of date.
#   scripts/build.sh                     everything: libraries, the parallax binary, tests, benches
#   scripts/build.sh --target parallax   only that target and what it links (the demo's build)
# Other arguments go to CMake's configure step (e.g. -DONNX_ROOT=... -DPARALLAX_PCH=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${PARALLAX_BUILD_DIR:-build}
TARGETS=()
CONFIGURE=()
while (($#)); do
  case "$1" in
    --target) TARGETS+=("$2"); shift 2 ;;
    --target=*) TARGETS+=("${1#--target=}"); shift ;;
    *) CONFIGURE+=("$1"); shift ;;
  esac
done
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-Release} "${CONFIGURE[@]}"
elif ((${#CONFIGURE[@]})); then
  cmake -S . -B "$BUILD" "${CONFIGURE[@]}"
fi
TARGET_ARGS=()
for t in "${TARGETS[@]}"; do TARGET_ARGS+=(--target "$t"); done
start=$(date +%s)
cmake --build "$BUILD" -j "${PARALLAX_JOBS:-$(nproc)}" "${TARGET_ARGS[@]}"
echo "[build] ${TARGETS[*]:-all targets} done in $(( $(date +%s) - start ))s: $BUILD/bin/parallax"
