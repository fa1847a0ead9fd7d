#!/usr/bin/env bash
# Builds and tests Parallax on a GPU node (CUDA LibTorch, NCCL from the torch wheel). Used on the
# project's H100/H200 machines (Ubuntu 24.04, CUDA 13, torch 2.11+cu130 in /opt/torch/.venv), which
# have no network: libonnx and protobuf come from Debian .deb files in .debs/ (scripts/fetch_onnx_debs.sh
# downloads them on a Debian 12 machine) unpacked into .deps/onnx; without them the build has no ONNX
# export (`parallax export --format onnx` says so) and tests/export is not built. Likewise
# libjpeg-turbo (JPEG image shards) from .debs/libturbojpeg*.deb (`apt-get download libturbojpeg0
# libturbojpeg0-dev` on Debian 12) into .deps/turbojpeg.
#   scripts/gpu_build.sh            # configure + build into build-gpu, then ctest
#   scripts/gpu_build.sh -L cuda    # extra arguments go to ctest
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD=${PARALLAX_BUILD_DIR:-build-gpu}
# The GPU image sets CXX=/opt/gcc/bin/g++, a GCC that ships only a static libstdc++; the system
# libraries we link (gtest, yaml-cpp, HDF5, OpenMPI) were built by the system g++ against the shared
# libstdc++. Build with the system compiler unless PARALLAX_CXX says otherwise.
export CXX=${PARALLAX_CXX:-/usr/bin/g++} CC=${PARALLAX_CC:-/usr/bin/gcc}
EXTRA=()
if ls .debs/libonnx*.deb >/dev/null 2>&1; then
  mkdir -p .deps/onnx
  for f in .debs/*.deb; do dpkg -x "$f" .deps/onnx; done
  EXTRA+=(-DONNX_ROOT="$PWD/.deps/onnx/usr")
  echo "[gpu_build] libonnx + protobuf from .debs/ (ONNX export enabled)"
else
  echo "[gpu_build] no .debs/libonnx*.deb: building without ONNX export (scripts/fetch_onnx_debs.sh fetches them)"
fi
if ls .debs/libturbojpeg*.deb >/dev/null 2>&1; then
  mkdir -p .deps/turbojpeg
  for f in .debs/libturbojpeg*.deb; do dpkg -x "$f" .deps/turbojpeg; done
  EXTRA+=(-DTURBOJPEG_ROOT="$PWD/.deps/turbojpeg/usr")
  echo "[gpu_build] libjpeg-turbo from .debs/ (JPEG image shards enabled)"
fi
# torchao (the PyTorch side of bench/train/fp8_compare.sh) from a carried wheel
# (`pip download torchao==0.17.0 --no-deps -d .debs` on a machine with network).
if ls .debs/torchao-*.whl >/dev/null 2>&1 && ! python3 -c "import torchao" 2>/dev/null; then
  python3 -m pip install --no-deps --no-index -q .debs/torchao-*.whl && echo "[gpu_build] torchao from .debs/"
fi
start=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_HOST_COMPILER="$CXX" "${EXTRA[@]}"
cmake --build "$BUILD" -j "$(nproc)"
echo "[gpu_build] built in $(( $(date +%s) - start ))s"
export LD_LIBRARY_PATH="$PWD/.deps/onnx/usr/lib/x86_64-linux-gnu:$PWD/.deps/turbojpeg/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
cd "$BUILD" && ctest --output-on-failure -j 4 "$@"
