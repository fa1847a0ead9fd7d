#!/usr/bin/env bash
# W2 (bev/base: 6 cameras, ViT-B/16 backbone, camera-geometry view transformer, BEV encoder,
# segmentation + CenterPoint heads; bf16, fused AdamW) on 1 and N GPUs: Parallax (`parallax train`,
# benchmark mode, configs/bench/w2_bev_base.yaml) and PyTorch (bench/train/torch_bev_ref.py, the
# same architecture in plain torch.nn, eager; `--compile` adds torch.compile) side by side in one
# command. Run after scripts/gpu_build.sh. Prints one JSON line per run; Parallax's line is the
# median of its logged intervals after the first (warm-up) one. A sample is one 6-camera scene.
#
# Fairness: the PyTorch run uses the scene whose parameter count equals the one `parallax train`
# logged (the trainer's benchmark scene), and the forward GFLOPs per sample that Parallax logged,
# so both sides count the same FLOPs (tflops_per_gpu = mfu * 989 for Parallax). `--bf16-grads`
# adds, on N GPUs, both sides with gradients all-reduced in bf16 (parallel.ddp.reduce_dtype=bf16
# against PyTorch's bf16_compress_hook), labelled "+bf16grads".
#   bench/train/run_w2.sh [--gpus N] [--batch B] [--compile] [--bf16-grads]
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
BUILD=${PARALLAX_BUILD_DIR:-build-gpu}
CONFIG=configs/bench/w2_bev_base.yaml
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
BATCH=$(sed -n 's/^  batch_size: *\([0-9]*\).*/\1/p' "$CONFIG")
COMPILE=0
BF16_GRADS=0
while (($#)); do
  case "$1" in
    --gpus) GPUS=$2; shift 2 ;;
    --batch) BATCH=$2; shift 2 ;;
    --compile) COMPILE=1; shift ;;
    --bf16-grads) BF16_GRADS=1; shift ;;
    *) echo "run_w2: unknown argument $1" >&2; exit 2 ;;
  esac
done
OUTDIR=${OUTDIR:-/tmp/parallax_w2}
mkdir -p "$OUTDIR"
summarise() {  # run dir, gpus, batch, impl label
  python3 - "$1" "$2" "$3" "$4" <<'PY'
import json, statistics, sys
run, gpus, batch, impl = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = [json.loads(l) for l in open(run + "/metrics.jsonl") if '"train"' in l]
rows = rows[1:] or rows  # the first interval holds the warm-up
ms = statistics.median(r["step_ms"] for r in rows)
mfu = statistics.median(r["mfu"] for r in rows)
print(json.dumps({"impl": impl, "workload": "W2 bev_base", "gpus": gpus, "batch_per_gpu": batch,
                  "sample": "one 6-camera scene", "step_ms": round(ms, 2),
                  "img_per_s": round(batch * gpus * 1000 / ms, 1),
                  "tflops_per_gpu": round(mfu * 989, 1), "mfu": round(mfu, 4),
                  "peak_mem_gb": round(rows[-1]["mem_gb"], 2),
                  **({"backward_ms": round(statistics.median(r["backward_ms"] for r in rows), 2),
                      "comm_exposed_ms": round(statistics.median(r["comm_exposed_ms"] for r in rows), 2)}
                     if "backward_ms" in rows[0] else {})}), flush=True)
PY
}
# The PyTorch scene whose parameter count (M, 3 decimals) matches Parallax's log line
# "model bev/base: <params> M parameters, <gflops> GFLOP forward per sample".
torch_scene() {  # parallax log
  python3 - "$1" <<'PY'
import json, re, subprocess, sys
m = re.search(r"model bev/base: ([0-9.]+) M parameters, ([0-9.]+) GFLOP forward per sample", open(sys.argv[1]).read())
if not m:
    sys.exit("run_w2: no model line in " + sys.argv[1])
for scene in ("benchmark", "default"):
    out = subprocess.run([sys.executable, "bench/train/torch_bev_ref.py", "--size", "base", "--scene", scene,
                          "--params-only"], check=True, capture_output=True, text=True).stdout
    if f"{json.loads(out)['params'] / 1e6:.3f}" == m.group(1):
        print(scene, m.group(2))
        sys.exit(0)
sys.exit(f"run_w2: no PyTorch scene has the {m.group(1)} M parameters of Parallax's bev/base")
PY
}
parallax() {  # gpus, run name, impl label, overrides...
  local n=$1 name=$2 impl=$3
  shift 3
  rm -rf "${OUTDIR:?}/$name"
  mpirun --oversubscribe --bind-to none -np "$n" "$BUILD/bin/parallax" train --config "$CONFIG" \
    "data.batch_size=$BATCH" "experiment.output_dir=$OUTDIR" "experiment.name=$name" "$@" > "$OUTDIR.log_$name" 2>&1 \
    || { tail -20 "$OUTDIR.log_$name"; exit 1; }
  summarise "$OUTDIR/$name" "$n" "$BATCH" "$impl"
}
for n in 1 "$GPUS"; do
  if [[ $n -lt 1 ]]; then continue; fi
  parallax "$n" "w2_$n" parallax
  SCENE_GFLOPS=$(torch_scene "$OUTDIR.log_w2_$n")
  read -r SCENE GFLOPS <<< "$SCENE_GFLOPS"
  REF=(bench/train/torch_bev_ref.py --size base --scene "$SCENE" --batch "$BATCH" --fwd-gflops-per-sample "$GFLOPS")
  if [[ $n -eq 1 ]]; then
    python3 "${REF[@]}" --mode eager
    if ((COMPILE)); then python3 "${REF[@]}" --mode compile; fi
  else
    TORCHRUN=(python3 -m torch.distributed.run --standalone --nproc-per-node "$n" "${REF[@]}")
    "${TORCHRUN[@]}" --mode eager
    if ((COMPILE)); then "${TORCHRUN[@]}" --mode compile; fi
    if ((BF16_GRADS)); then
      parallax "$n" "w2_${n}_bf16grads" parallax+bf16grads parallel.ddp.reduce_dtype=bf16
      "${TORCHRUN[@]}" --mode eager --grad-dtype bf16
      if ((COMPILE)); then "${TORCHRUN[@]}" --mode compile --grad-dtype bf16; fi
    fi
  fi
  if [[ $GPUS -eq 1 ]]; then break; fi
done
