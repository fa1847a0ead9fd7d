#!/usr/bin/env bash
# W1 (ViT-B/16, batch 128/GPU, bf16, AdamW) on 1 and N GPUs: Parallax (`parallax train`, benchmark
# mode) and PyTorch (timm, eager; `--compile` adds torch.compile) side by side in one command.
# Run after scripts/gpu_build.sh. Prints one JSON line per run; Parallax's line is the median of
# its logged intervals after the first (warm-up) one. `--bf16-grads` adds, on N GPUs, both sides
# with gradients all-reduced in bf16 (parallel.ddp.reduce_dtype=bf16 against PyTorch's
# bf16_compress_hook), labelled "+bf16grads".
#   bench/train/run_w1.sh [--gpus N] [--compile] [--bf16-grads]
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BUILD=${PARALLAX_BUILD_DIR:-build-gpu}
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
COMPILE=0
BF16_GRADS=0
while (($#)); do
  case "$1" in
    --gpus) GPUS=$2; shift 2 ;;
    --compile) COMPILE=1; shift ;;
    --bf16-grads) BF16_GRADS=1; shift ;;
    *) echo "run_w1: unknown argument $1" >&2; exit 2 ;;
  esac
done
OUTDIR=${OUTDIR:-/tmp/parallax_w1}
summarise() {  # run dir, gpus, impl label
  python3 - "$1" "$2" "$3" <<'PY'
import json, statistics, sys
run, gpus, impl = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = [json.loads(l) for l in open(run + "/metrics.jsonl") if '"train"' in l]
rows = rows[1:] or rows  # the first interval holds the warm-up
ms = statistics.median(r["step_ms"] for r in rows)
print(json.dumps({"impl": impl, "workload": "W1 vit_b16", "gpus": gpus, "batch_per_gpu": 128,
                  "step_ms": round(ms, 2), "img_per_s": round(128 * gpus * 1000 / ms, 1),
                  "tflops_per_gpu": round(3 * 35.13e9 * 128 / (ms / 1000) / 1e12, 1),
                  "mfu": round(statistics.median(r["mfu"] for r in rows), 4),
                  "peak_mem_gb": round(rows[-1]["mem_gb"], 2),
                  **({"backward_ms": round(statistics.median(r["backward_ms"] for r in rows), 2),
                      "comm_exposed_ms": round(statistics.median(r["comm_exposed_ms"] for r in rows), 2)}
                     if "backward_ms" in rows[0] else {})}), flush=True)
PY
}
parallax() {  # gpus, run name, impl label, overrides...
  local n=$1 name=$2 impl=$3
  shift 3
  rm -rf "${OUTDIR:?}/$name"
  mpirun --oversubscribe --bind-to none -np "$n" "$BUILD/bin/parallax" train --config configs/bench/w1_vit_b16.yaml \
    "experiment.output_dir=$OUTDIR" "experiment.name=$name" "$@" > "$OUTDIR.log_$name" 2>&1 \
    || { tail -20 "$OUTDIR.log_$name"; exit 1; }
  summarise "$OUTDIR/$name" "$n" "$impl"
}
torchrun() {  # gpus, script arguments...
  local n=$1
  shift
  python3 -m torch.distributed.run --standalone --nproc-per-node "$n" bench/train/torch_vit_ref.py --batch 128 "$@"
}
for n in 1 "$GPUS"; do
  if [[ $n -lt 1 ]]; then continue; fi
  parallax "$n" "w1_$n" parallax
  if [[ $n -eq 1 ]]; then
    python3 bench/train/torch_vit_ref.py --batch 128 --mode eager
    if ((COMPILE)); then python3 bench/train/torch_vit_ref.py --batch 128 --mode compile; fi
  else
    torchrun "$n" --mode eager
    if ((COMPILE)); then torchrun "$n" --mode compile; fi
    if ((BF16_GRADS)); then
      parallax "$n" "w1_${n}_bf16grads" parallax+bf16grads parallel.ddp.reduce_dtype=bf16
      torchrun "$n" --mode eager --grad-dtype bf16
      if ((COMPILE)); then torchrun "$n" --mode compile --grad-dtype bf16; fi
    fi
  fi
  if [[ $GPUS -eq 1 ]]; then break; fi
done
