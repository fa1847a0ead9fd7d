#!/usr/bin/env bash
# fp32 against PTQ and QAT INT8 on bev_tiny (CPU): docs/PERFORMANCE.md, "Quantization". Run from the repository root.
set -x
P=${PARALLAX:-build/bin/parallax}
OUT=${OUT:-/tmp/qr}
mkdir -p "$OUT"
export OMP_NUM_THREADS=2
time $P datagen --out $OUT/data --scenes 48 --val-scenes 8 --threads 2 --samples-per-pixel 1
C="--config configs/bev_tiny.yaml experiment.output_dir=$OUT data.path=$OUT/data train.device=cpu data.batch_size=4 train.log_every=50"
time $P train $C experiment.name=fp32 train.steps=400 train.eval_every=400
time $P train $C experiment.name=ptq train.load_from=$OUT/fp32 qat.enabled=true qat.mode=ptq qat.calib_batches=8
time $P train $C experiment.name=qat train.load_from=$OUT/fp32 qat.enabled=true qat.mode=qat qat.calib_batches=8 train.steps=100 train.eval_every=100 optim.lr=1e-4
echo ALLDONE
