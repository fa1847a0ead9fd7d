#!/usr/bin/env bash
# LoRA against a full fine-tune on W1 (ViT-B/16, batch 128 per GPU, bf16) on one GPU: step time
# and peak memory, the two run alternately REPS times. A one-step run first saves the base
# checkpoint the LoRA runs adapt. One JSON line per run (median step time of the logged intervals
# after the first; peak device memory, metrics "mem_gb").
#   bench/lora/w1_lora.sh [REPS=2] [RANK=16] [-- extra overrides, e.g. train.cuda_graph=false]
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
REPS=${1:-2} RANK=${2:-16}
shift $(( $# >= 2 ? 2 : $# ))
[[ "${1:-}" == "--" ]] && shift
BIN=${PARALLAX_BIN:-build-gpu/bin/parallax}
OUT=${OUTDIR:-/tmp/parallax_lora_w1}
mkdir -p "$OUT"
CFG=configs/bench/w1_vit_b16.yaml
rm -rf "${OUT:?}/base"
"$BIN" train --config $CFG "experiment.output_dir=$OUT" experiment.name=base train.benchmark=false \
  train.steps=1 train.cuda_graph=false > "$OUT/base.log" 2>&1 || { tail -5 "$OUT/base.log"; exit 1; }
run() {  # name, overrides
  local name=$1
  shift
  rm -rf "${OUT:?}/$name"
  "$BIN" train --config $CFG "experiment.output_dir=$OUT" "experiment.name=$name" "$@" \
    > "$OUT/$name.log" 2>&1 || { tail -5 "$OUT/$name.log"; exit 1; }
  python3 - "$OUT/$name" "$name" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"train"' in l][1:]
print(json.dumps({"run": sys.argv[2], "step_ms": round(statistics.median(r["step_ms"] for r in rows), 2),
                  "intervals": len(rows), "peak_mem_gb": round(rows[-1]["mem_gb"], 2)}), flush=True)
PY
}
for rep in $(seq 1 "$REPS"); do
  run "full_$rep" "train.load_from=$OUT/base" "$@"
  run "lora_$rep" "lora.rank=$RANK" "lora.base=$OUT/base" "$@"
done
grep -h "LoRA:" "$OUT/lora_1.log" | head -1
