#!/usr/bin/env bash
# Issue 24, row 3: Megatron TP in Parallax against PyTorch DTensor TP (`parallelize_module`) on the
# ViT-L-class BEV model (`bev` size `large`, 6 x 256x704 cameras, bf16 autocast, fused AdamW),
# tp = GPUS with and without sequence parallelism, both sides in one command on one node. Every rank
# of the tp group sees the same batch (BATCH scenes per step). One JSON line per run: median step
# time (Parallax: of the logged intervals after the first; PyTorch: of its timed windows), samples/s
# and peak device memory.
#   bench/tensor/compare_dtensor.sh [GPUS=2] [BATCH=8] [REPS=1]
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# mpirun as root (the GPU images run commands as root):
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
GPUS=${1:-2} BATCH=${2:-8} REPS=${3:-1}
BIN=${PARALLAX_BIN:-build-gpu/bin/parallax}
PY=${PYTHON:-python3}
OUTDIR=${OUTDIR:-/tmp/parallax_tp_compare}
mkdir -p "$OUTDIR"
echo "[compare_dtensor] $(date -u +%Y-%m-%dT%H:%M:%SZ) tp $GPUS, batch $BATCH: $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
for rep in $(seq 1 "$REPS"); do
  for sp in false true; do
    name="tp${GPUS}_sp${sp}_$rep"
    rm -rf "${OUTDIR:?}/$name"
    mpirun --oversubscribe --bind-to none -np "$GPUS" "$BIN" train --config configs/bench/w2_bev_base.yaml \
      model.size=large "parallel.tp=$GPUS" "parallel.sequence_parallel=$sp" "data.batch_size=$BATCH" \
      "experiment.output_dir=$OUTDIR" "experiment.name=$name" > "$OUTDIR/$name.log" 2>&1 \
      || { tail -5 "$OUTDIR/$name.log"; exit 1; }
    "$PY" - "$OUTDIR/$name" "$GPUS" "$sp" "$BATCH" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"train"' in l][1:]
step = statistics.median(r["step_ms"] for r in rows)
print(json.dumps({"impl": "parallax", "workload": "bev_large", "tp": int(sys.argv[2]), "sp": sys.argv[3] == "true",
                  "batch_per_tp_group": int(sys.argv[4]), "step_ms": round(step, 2),
                  "img_per_s": round(int(sys.argv[4]) * 1000.0 / step, 2), "intervals": len(rows),
                  "peak_mem_gb": round(rows[-1]["mem_gb"], 2)}), flush=True)
PY
    log="$OUTDIR/torch_tp${GPUS}_sp${sp}_$rep.log"
    SPFLAG=()
    [[ "$sp" == true ]] && SPFLAG=(--sp)
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" bench/train/torch_bev_ref.py \
      --size large --batch "$BATCH" --tp "$GPUS" "${SPFLAG[@]}" > "$log" 2>&1 || { tail -20 "$log"; exit 1; }
    grep '^{' "$log"
  done
done
