#!/usr/bin/env bash
# Downloads libonnx and protobuf (headers and libraries) as Debian 12 .deb files into .debs/, for
# machines without network or without these packages (the GPU nodes): scripts/gpu_build.sh unpacks
# every .debs/*.deb into .deps/onnx and configures with -DONNX_ROOT, which enables ONNX export.
# Run on a Debian 12 machine with apt (this one); carry .debs/ to the GPU node.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .debs
cd .debs
apt-get download libonnx-dev libonnx1 libprotobuf-dev libprotobuf32 libprotobuf-lite32
ls -l ./*.deb
