#!/usr/bin/env bash
# The whole GPU comparison of issue 7 in one command on a GPU node (<= 10 min on 2 x H200):
# W1 (ViT-B/16) and W2 (bev/base), Parallax against PyTorch eager, torch.compile and torchrun DDP,
# on 1 GPU and on every GPU of the node. Builds first if build-gpu is missing.
#   bench/run_gpu.sh [--gpus N] [--no-compile] [--zero] [--tp] [--pp] [--3d]
# The multi-GPU rows of issue 24 on the node's GPUs (or N), one JSON line per run in the same file:
#   --zero  ZeRO-1/2/3 and DDP against PyTorch DDP and FSDP2 on W1 (bench/zero/compare_w1.sh)
#   --tp    tp = N with and without SP against DTensor TP on bev large (bench/tensor/compare_dtensor.sh)
#   --pp    every schedule's bubble at pp = N against torch.distributed.pipelining
#           (bench/pipeline/compare_gpu.sh)
#   --3d    dp 2 x tp 2 x pp 2 on the 3b model against the planner (bench/train/run_3d.sh; 8 GPUs)
# Writes bench_gpu.jsonl (one JSON line per run, each written as soon as its run ends, so a run cut
# short keeps the lines before it) and prints a Markdown table of it. The rows with
# gradients all-reduced in bf16 on both sides come from bench/train/run_w1.sh --bf16-grads (and
# run_w2.sh --bf16-grads), outside this command's 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD=${PARALLAX_BUILD_DIR:-build-gpu}
ARGS=()
COMPILE=(--compile)
ZERO=0 TP=0 PP=0 THREED=0
GPUS=""
while (($#)); do
  case "$1" in
    --gpus) ARGS+=(--gpus "$2"); GPUS=$2; shift 2 ;;
    --zero) ZERO=1; shift ;;
    --tp) TP=1; shift ;;
    --pp) PP=1; shift ;;
    --3d) THREED=1; shift ;;
    --no-compile) COMPILE=(); shift ;;
    *) echo "run_gpu: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ -x "$BUILD/bin/parallax" ]] || scripts/gpu_build.sh -R NONE >/dev/null
echo "[run_gpu] $(date -u +%Y-%m-%dT%H:%M:%SZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
: > bench_gpu.jsonl
bench/train/run_w1.sh "${ARGS[@]}" "${COMPILE[@]}" | grep --line-buffered '^{' | tee -a bench_gpu.jsonl
bench/train/run_w2.sh "${ARGS[@]}" "${COMPILE[@]}" | grep --line-buffered '^{' | tee -a bench_gpu.jsonl
python3 bench/train/table.py bench_gpu.jsonl
N=${GPUS:-$(nvidia-smi -L | wc -l)}
if ((ZERO)); then bench/zero/compare_w1.sh "$N" | grep --line-buffered '^{' | tee -a bench_gpu.jsonl; fi
if ((TP)); then bench/tensor/compare_dtensor.sh "$N" | grep --line-buffered '^{' | tee -a bench_gpu.jsonl; fi
if ((PP)); then bench/pipeline/compare_gpu.sh "$N" | grep --line-buffered '^{' | tee -a bench_gpu.jsonl; fi
if ((THREED)); then bench/train/run_3d.sh 2 2 2 | grep --line-buffered '^{' | tee -a bench_gpu.jsonl; fi
