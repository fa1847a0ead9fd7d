#!/usr/bin/env bash
# Temporal bev_tiny (2 frames) against single-frame bev_tiny (issue 61), both with the velocity
# head, on synthetic sequences (datagen --sequence-length 4: 96 train + 32 val scenes, 2 cameras of
# 64 x 112), 3 seeds each, 400 steps at batch 2 on the CPU (one thread per run, two runs at once);
# prints each run's eval (mAP, mAVE, NDS) and the mean, min and max per side.
#   bench/train/temporal_vs_single.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
D=${1:-/tmp/parallax_temporal_vs_single}; B=${PARALLAX_BUILD_DIR:-build}/bin/parallax
SRC=$PWD
mkdir -p "$D"
[[ -f "$D/seq/dataset.json" ]] || "$B" datagen --out "$D/seq" --scenes 96 --val-scenes 32 --sequence-length 4 \
  --cameras 2 --height 64 --width 112 --samples-per-pixel 1 > /dev/null
one() {  # name seed extra...
  local name=$1 seed=$2; shift 2
  rm -rf "${D:?}/$name"
  OMP_NUM_THREADS=1 "$B" train --config "$SRC/configs/bev_tiny.yaml" data.path="$D/seq" experiment.output_dir="$D" \
    experiment.name=$name experiment.seed=$seed model.backbone=conv model.velocity=true data.batch_size=2 \
    data.num_workers=1 train.steps=400 train.eval_every=400 train.log_every=100 train.device=cpu "$@" > "$D/$name.log" 2>&1
}
for seed in 1 2 3; do
  one single_$seed $seed &
  one temporal_$seed $seed model.temporal.frames=2 data.frames=2 &
  wait
done
python3 - "$D" <<'PY'
import json, os, statistics, sys
d = sys.argv[1]
for kind in ("single", "temporal"):
    rows = []
    for seed in (1, 2, 3):
        with open(os.path.join(d, f"{kind}_{seed}", "metrics.jsonl")) as f:
            rows.append([json.loads(l) for l in f if '"eval"' in l][-1])
    for r, seed in zip(rows, (1, 2, 3)):
        print(json.dumps({"run": f"{kind}_{seed}", **{k: round(r[k], 4) for k in ("map", "ave", "nds", "nds_no_aae", "miou")}}))
    for k in ("map", "ave", "nds", "nds_no_aae", "miou"):
        v = [r[k] for r in rows]
        print(f"{kind} {k}: mean {statistics.mean(v):.4f} min {min(v):.4f} max {max(v):.4f}")
PY
