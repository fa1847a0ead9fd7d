#!/usr/bin/env bash
# Export time, model size and ONNX Runtime CPU latency per frame of the bev model (docs/PERFORMANCE.md).
#   bench/export/run_export_bench.sh [BUILD_DIR] [SIZE:BACKBONE...]   # default: build tiny:conv tiny:vit base:vit
# Per model: a run trained one step on synthetic data (batch 1: the checkpoint only
# needs to exist), then `parallax export` with a 2-frame parity gate (its own timings: graph build +
# libonnx checks + write, LibTorch reference, ONNX Runtime tool), then ort_latency.py on frame 0.
# Prints one JSON line per size. CPU only; bev_base takes minutes per step on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build}
shift || true
MODELS=("$@")
[[ ${#MODELS[@]} -eq 0 ]] && MODELS=(tiny:conv tiny:vit base:vit)
PARALLAX="$BUILD/bin/parallax"
PY=${PARALLAX_PYTHON:-python3}
OUT=$(mktemp -d /tmp/parallax_export_bench.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
for m in "${MODELS[@]}"; do
  size=${m%:*} backbone=${m#*:} name="bev_${size}_${backbone}"
  "$PARALLAX" train --config configs/bev_tiny.yaml experiment.output_dir="$OUT" experiment.name="$name" \
    model.size="$size" model.backbone="$backbone" data.synthetic=true data.batch_size=1 train.steps=1 train.eval_every=0 \
    >"$OUT/train_$name.log" 2>&1
  start=$(date +%s.%N)
  "$PARALLAX" export --run "$OUT/$name" --parity-frames 2 >"$OUT/export_$name.log" 2>&1
  end=$(date +%s.%N)
  graph_s=$(sed -n 's/.* in \([0-9.]*\) s$/\1/p' "$OUT/export_$name.log" | head -1)
  times=$(sed -n 's/.*(LibTorch \([0-9.]*\) s, ONNX Runtime tool \([0-9.]*\) s)/\1 \2/p' "$OUT/export_$name.log")
  lat=$("$PY" bench/export/ort_latency.py "$OUT/$name/export/model.onnx" "$OUT/$name/export/parity.h5" \
        --warmup 1 --iters "${ITERS:-5}")
  parity=$("$PY" -c "import json, sys; r = json.load(open(sys.argv[1])); print(json.dumps({k: {'max_rel': v['max_rel'], \
'min_cosine': v['min_cosine']} for k, v in r['outputs'].items()}))" "$OUT/$name/export/parity.json")
  echo "{\"bench\": \"export\", \"model\": \"$name\", \"export_total_s\": $(echo "$end - $start" | bc),"\
       "\"graph_s\": $graph_s, \"reference_s_2_frames\": ${times% *}, \"parity_tool_s_2_frames\": ${times#* },"\
       "\"ort\": $lat, \"parity\": $parity}"
done
