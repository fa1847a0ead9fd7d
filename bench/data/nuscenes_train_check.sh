#!/usr/bin/env bash
# Issue 38's training check of the nuScenes converter: bev_tiny trained the same steps on datagen's
# native dataset and on the same scenes written by `datagen --layout nuscenes` and converted back by
# `convert nuscenes` (the synthetic categories mapped back to vehicle/pedestrian/cyclist, BEV labels
# from the map expansion layers); the final evaluation's mAP side by side. Target: within 10 %.
#   bench/data/nuscenes_train_check.sh [BUILD=build] [DEVICE=cuda]   # SCENES=1200 VAL=200 STEPS=1500
set -uo pipefail
cd "$(dirname "$0")/../.."
P=${1:-build}/bin/parallax DEV=${2:-cuda}
N=${SCENES:-1200} V=${VAL:-200} T=$(nproc)
W=$(mktemp -d /tmp/parallax_nusc_check.XXXXXX)
OMP_NUM_THREADS=1 $P datagen --out $W/native --scenes $N --val-scenes $V --threads $T --seed 3 2>&1 | tail -1
OMP_NUM_THREADS=1 $P datagen --layout nuscenes --out $W/nusc --scenes $N --val-scenes $V --threads $T --seed 3 2>&1 | tail -1
printf 'vehicle.car: vehicle\nhuman.pedestrian.adult: pedestrian\nvehicle.bicycle: cyclist\n' > $W/classes.yaml
OMP_NUM_THREADS=1 $P convert nuscenes --dataroot $W/nusc --out $W/conv --splits $W/nusc/parallax_splits.json \
  --classes $W/classes.yaml --bev-range 25 --workers $T 2>&1 | tail -1
for D in native conv; do
  $P train --config configs/bev_tiny.yaml data.path=$W/$D train.device=$DEV train.steps=${STEPS:-1500} \
    train.eval_every=0 train.log_every=250 data.batch_size=8 data.num_workers=$((T > 8 ? 6 : 1)) \
    experiment.output_dir=$W/runs experiment.name=$D > $W/$D.log 2>&1 || { tail -5 $W/$D.log; exit 1; }
  python3 -c "
import json
rows=[json.loads(l) for l in open('$W/runs/$D/metrics.jsonl') if l.strip()]
e=[r for r in rows if r['kind']=='eval'][-1]
print(json.dumps({'dataset': '$D', **{k: round(v, 4) for k, v in e.items() if k in ('step', 'map', 'map_2m', 'miou', 'nds', 'val_loss') or k.startswith('ap_2m')}}))"
done
echo "work folder: $W"
