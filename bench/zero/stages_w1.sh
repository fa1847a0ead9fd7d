#!/usr/bin/env bash
# W1 (ViT-B/16, batch 128 per GPU, bf16, eager: ZeRO refuses CUDA graphs) under each ZeRO stage, on
# GPUS GPUs of one node (mpirun when more than one), the stages run alternately REPS times so
# that drift on the machine hits every stage alike. One JSON line per run: median step time of the
# logged intervals after the first, and the peak device memory (metrics "mem_gb").
#   bench/zero/stages_w1.sh [GPUS=1] [REPS=3] [STAGES="0 3"] [-- extra overrides]
# e.g. the engine-overhead check of issue 18 (ZeRO-3 within 3% of DDP at world 1):
#   bench/zero/stages_w1.sh 1 3 "0 3"
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# mpirun as root (the GPU images run commands as root):
if [[ $(id -u) == 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
GPUS=${1:-1} REPS=${2:-3} STAGES=${3:-"0 3"}
shift $(( $# >= 3 ? 3 : $# ))
[[ "${1:-}" == "--" ]] && shift
BIN=${PARALLAX_BIN:-build-gpu/bin/parallax}
OUTDIR=${OUTDIR:-/tmp/parallax_zero_stages}
LAUNCH=()
if ((GPUS > 1)); then LAUNCH=(mpirun --oversubscribe --bind-to none -np "$GPUS"); fi
mkdir -p "$OUTDIR"
for rep in $(seq 1 "$REPS"); do
  for st in $STAGES; do
    name="s${st}_g${GPUS}_$rep"
    rm -rf "${OUTDIR:?}/$name"
    "${LAUNCH[@]}" "$BIN" train --config configs/bench/w1_vit_b16.yaml "experiment.output_dir=$OUTDIR" \
      "experiment.name=$name" "parallel.zero.stage=$st" train.cuda_graph=false "$@" \
      > "$OUTDIR/$name.log" 2>&1 || { tail -5 "$OUTDIR/$name.log"; exit 1; }
    python3 - "$OUTDIR/$name" "$st" "$GPUS" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"train"' in l][1:]
print(json.dumps({"stage": int(sys.argv[2]), "gpus": int(sys.argv[3]),
                  "step_ms": round(statistics.median(r["step_ms"] for r in rows), 2),
                  "intervals": len(rows), "peak_mem_gb": round(rows[-1]["mem_gb"], 2)}), flush=True)
PY
  done
done
