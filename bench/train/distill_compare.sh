#!/usr/bin/env bash
# A bev_tiny student (conv backbone) distilled from a teacher with the ViT backbone, against the same
# student trained alone for equal steps, on CPU: docs/PERFORMANCE.md, "Distillation". Run from the
# repository root; reuses $OUT/data when it exists (bench/train/qat_compare.sh makes it).
set -x
P=${PARALLAX:-build/bin/parallax}
OUT=${OUT:-/tmp/qr}
mkdir -p "$OUT"
export OMP_NUM_THREADS=2
[ -d $OUT/data ] || $P datagen --out $OUT/data --scenes 48 --val-scenes 8 --threads 2 --samples-per-pixel 1
C="--config configs/bev_tiny.yaml experiment.output_dir=$OUT data.path=$OUT/data train.device=cpu data.batch_size=4 train.log_every=50"
time $P train $C experiment.name=teacher model.backbone=vit train.steps=600 train.eval_every=600
time $P train $C experiment.name=alone train.steps=200 train.eval_every=200
time $P train $C experiment.name=distilled train.steps=200 train.eval_every=200 distill.teacher=$OUT/teacher distill.teacher_backbone=vit
echo ALLDONE
