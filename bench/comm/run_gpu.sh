#!/usr/bin/env bash
# Comm benchmark on 2 GPUs: Parallax's nccl backend (native and ring all-reduce, reduce-scatter,
# all-gather) against raw NCCL calls, then the torch.distributed reference, 1 KiB .. 1 GiB.
# Run after scripts/gpu_build.sh (which builds into build-gpu):
#   bench/comm/run_gpu.sh [extra comm_bench arguments, e.g. --dtype bfloat16]
# Writes JSON lines to bench_comm_gpu.jsonl (ours + raw NCCL) and bench_comm_torch.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BUILD=${PARALLAX_BUILD_DIR:-build-gpu}
PY=${PARALLAX_PYTHON:-python3}
echo "[run_gpu] $(date -u +%Y-%m-%dT%H:%M:%SZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -2 | paste -sd,)"
mpirun --oversubscribe --bind-to none -np 2 "$BUILD/bin/comm_bench" --backend nccl --max-bytes 1G "$@" \
  | tee bench_comm_gpu.jsonl
"$PY" -m torch.distributed.run --standalone --nproc-per-node 2 bench/comm/torch_comm_bench.py --max-bytes 1G \
  | tee bench_comm_torch.jsonl
