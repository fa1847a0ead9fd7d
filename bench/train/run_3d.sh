#!/usr/bin/env bash
# Issue 24, row 5: dp x tp x pp on one node (default dp 2 x tp 2 x pp 2 on 8 GPUs) on the `3b` BEV
# model, against the planner's prediction for the same layout. Prints three JSON lines: the
# planner's prediction (`parallax plan --only-config`, per-GPU peak memory and step time), the
# measured run (median step time of the logged intervals after the first, the allocator's peak on
# rank 0, MFU as the trainer logs it) and their ratios (the issue's bounds: time within 20%,
# memory within 10%).
#   bench/train/run_3d.sh [DP=2] [TP=2] [PP=2] [-- extra overrides]
# Environment: SIZE (3b), MICRO (micro-batch per dp rank, 1), ACCUM (micro-batches per step, 8),
# STEPS (12), DEVICE (cuda; cpu for a smoke run on CPU ranks with BIN=build/bin/parallax),
# CALIBRATE (1: `plan --calibrate` on one device first; 0: the planner's defaults).
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# mpirun as root (the GPU images run commands as root):
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
DP=${1:-2} TP=${2:-2} PP=${3:-2}
shift $(( $# >= 3 ? 3 : $# ))
[[ "${1:-}" == "--" ]] && shift
SIZE=${SIZE:-3b} MICRO=${MICRO:-1} ACCUM=${ACCUM:-8} STEPS=${STEPS:-12} DEVICE=${DEVICE:-cuda}
CALIBRATE=${CALIBRATE:-1}
BIN=${BIN:-build-gpu/bin/parallax}
PY=${PYTHON:-python3}
OUTDIR=${OUTDIR:-/tmp/parallax_3d}
N=$((DP * TP * PP))
mkdir -p "$OUTDIR"
name="dp${DP}_tp${TP}_pp${PP}_${SIZE}"
rm -rf "${OUTDIR:?}/$name"
OVR=(model.size="$SIZE" parallel.dp="$DP" parallel.tp="$TP" parallel.pp="$PP" data.batch_size="$MICRO"
     train.grad_accum="$ACCUM" train.steps="$STEPS" train.log_every=2 train.device="$DEVICE" "$@")
PLAN=(--gpus "$N" --only-config --json "$OUTDIR/$name.plan.json")
if [[ "$DEVICE" == cuda ]]; then
  echo "[run_3d] $(date -u +%Y-%m-%dT%H:%M:%SZ) $N GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
  PLAN+=(--device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -qi h100 && echo h100 || echo h200)")
  ((CALIBRATE)) && PLAN+=(--calibrate --calibrate-batch "$MICRO")
else
  PLAN+=(--device cpu)
fi
"$BIN" plan --config configs/bench/w2_bev_base.yaml "${PLAN[@]}" "${OVR[@]}" > "$OUTDIR/$name.plan.log" 2>&1 \
  || { tail -5 "$OUTDIR/$name.plan.log"; exit 1; }
mpirun --oversubscribe --bind-to none -np "$N" "$BIN" train --config configs/bench/w2_bev_base.yaml \
  "experiment.output_dir=$OUTDIR" "experiment.name=$name" "${OVR[@]}" > "$OUTDIR/$name.log" 2>&1 \
  || { tail -5 "$OUTDIR/$name.log"; exit 1; }
"$PY" - "$OUTDIR/$name" "$OUTDIR/$name.plan.json" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"train"' in l][1:]
plan = json.load(open(sys.argv[2]))
[layout] = [x for x in plan["layouts"] if x["configured"]]
pred = {"kind": "predicted", "step_ms": round(layout["time"]["step_ms"], 2),
        "peak_gib": round(layout["peak"]["allocated"] / 2**30, 2), "source": plan["hardware"].get("source")}
step = statistics.median(r["step_ms"] for r in rows)
meas = {"kind": "measured", "step_ms": round(step, 2), "peak_gib": round(max(r.get("mem_gb", 0) for r in rows), 2),
        "mfu": rows[-1].get("mfu"), "img_per_s": rows[-1].get("img_per_s"), "intervals": len(rows)}
print(json.dumps(pred))
print(json.dumps(meas))
print(json.dumps({"kind": "ratio", "step": round(pred["step_ms"] / meas["step_ms"], 3),
                  "peak": round(pred["peak_gib"] / meas["peak_gib"], 3) if meas["peak_gib"] else None}))
PY
