#!/usr/bin/env bash
# W1 (ViT-B/16, batch 128/GPU, bf16, AdamW) on 1 and N GPUs: Parallax (`parallax train`, benchmark
# mode) and PyTorch (timm, eager; `--compile` adds torch.compile) side by side in one command.
# Run after scripts/gpu_build.sh. Prints one JSON line per run; Parallax's line is the median of
# its logged intervals after the first (warm-up) one.
#   bench/train/run_w1.sh [--gpus N] [--compile]
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BUILD=${PARALLAX_BUILD_DIR:-build-gpu}
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
COMPILE=0
while (($#)); do
  case "$1" in
    --gpus) GPUS=$2; shift 2 ;;
    --compile) COMPILE=1; shift ;;
    *) echo "run_w1: unknown argument $1" >&2; exit 2 ;;
  esac
done
OUTDIR=${OUTDIR:-/tmp/parallax_w1}
summarise() {  # run dir, gpus
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
run, gpus = sys.argv[1], int(sys.argv[2])
rows = [json.loads(l) for l in open(run + "/metrics.jsonl") if '"train"' in l]
rows = rows[1:] or rows  # the first interval holds the warm-up
ms = statistics.median(r["step_ms"] for r in rows)
print(json.dumps({"impl": "parallax", "workload": "W1 vit_b16", "gpus": gpus, "batch_per_gpu": 128,
                  "step_ms": round(ms, 2), "img_per_s": round(128 * gpus * 1000 / ms, 1),
                  "tflops_per_gpu": round(3 * 35.13e9 * 128 / (ms / 1000) / 1e12, 1),
                  "mfu": round(statistics.median(r["mfu"] for r in rows), 4),
                  "peak_mem_gb": round(rows[-1]["mem_gb"], 2),
                  **({"backward_ms": round(statistics.median(r["backward_ms"] for r in rows), 2),
                      "comm_exposed_ms": round(statistics.median(r["comm_exposed_ms"] for r in rows), 2)}
                     if "backward_ms" in rows[0] else {})}), flush=True)
PY
}
for n in 1 "$GPUS"; do
  if [[ $n -lt 1 ]]; then continue; fi
  rm -rf "$OUTDIR/w1_$n"
  mpirun --oversubscribe --bind-to none -np "$n" "$BUILD/bin/parallax" train --config configs/bench/w1_vit_b16.yaml \
    "experiment.output_dir=$OUTDIR" "experiment.name=w1_$n" > "$OUTDIR.log_$n" 2>&1 || { tail -20 "$OUTDIR.log_$n"; exit 1; }
  summarise "$OUTDIR/w1_$n" "$n"
  if [[ $n -eq 1 ]]; then
    python3 bench/train/torch_vit_ref.py --batch 128 --mode eager
    if ((COMPILE)); then python3 bench/train/torch_vit_ref.py --batch 128 --mode compile; fi
  else
    python3 -m torch.distributed.run --standalone --nproc-per-node "$n" bench/train/torch_vit_ref.py --batch 128 --mode eager
    if ((COMPILE)); then python3 -m torch.distributed.run --standalone --nproc-per-node "$n" bench/train/torch_vit_ref.py --batch 128 --mode compile; fi
  fi
  if [[ $GPUS -eq 1 ]]; then break; fi
done
