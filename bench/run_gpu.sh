#!/usr/bin/env bash
# The whole GPU comparison of issue 7 in one command on a GPU node (<= 10 min on 2 x H200):
# W1 (ViT-B/16) and W2 (bev/base), Parallax against PyTorch eager, torch.compile and torchrun DDP,
# on 1 GPU and on every GPU of the node. Builds first if build-gpu is missing.
#   bench/run_gpu.sh [--gpus N] [--no-compile]
# Writes bench_gpu.jsonl (one JSON line per run) and prints a Markdown table of it. The rows with
# gradients all-reduced in bf16 on both sides come from bench/train/run_w1.sh --bf16-grads (and
# run_w2.sh --bf16-grads), outside this command's 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD=${PARALLAX_BUILD_DIR:-build-gpu}
ARGS=()
COMPILE=(--compile)
while (($#)); do
  case "$1" in
    --gpus) ARGS+=(--gpus "$2"); shift 2 ;;
    --no-compile) COMPILE=(); shift ;;
    *) echo "run_gpu: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x "$BUILD/bin/parallax" ]] || scripts/gpu_build.sh -R NONE >/dev/null
echo "[run_gpu] $(date -u +%Y-%m-%dT%H:%M:%SZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
: > bench_gpu.jsonl
bench/train/run_w1.sh "${ARGS[@]}" "${COMPILE[@]}" | grep '^{' | tee -a bench_gpu.jsonl
bench/train/run_w2.sh "${ARGS[@]}" "${COMPILE[@]}" | grep '^{' | tee -a bench_gpu.jsonl
python3 bench/train/table.py bench_gpu.jsonl
