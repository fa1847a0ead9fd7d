#!/usr/bin/env bash
# fp32 against PTQ and QAT INT8, and the mixed-precision sweep (docs/PERFORMANCE.md, "Quantization").
# Run from the repository root.
#   bench/train/qat_compare.sh                     # bev_tiny on the CPU (the recorded CPU numbers)
#   MODEL="model.size=base model.backbone=vit" DEVICE=cuda BATCH=8 STEPS=1500 QAT_STEPS=300 \
#     SCENES=400 VAL_SCENES=50 THREADS=0 PRECISION=bf16 LR=3e-4 QAT_LR=3e-5 \
#     bench/train/qat_compare.sh                   # bev base on one GPU
# The QAT fine-tune and PTQ start from the fp32 run; every run evaluates on the same val scenes.
set -x
P=${PARALLAX:-build/bin/parallax}
OUT=${OUT:-/tmp/qr}
MODEL=${MODEL:-}
DEVICE=${DEVICE:-cpu}
BATCH=${BATCH:-4}
STEPS=${STEPS:-400}
QAT_STEPS=${QAT_STEPS:-100}
SCENES=${SCENES:-48}
VAL_SCENES=${VAL_SCENES:-8}
THREADS=${THREADS:-2}
PRECISION=${PRECISION:-fp32}
LR=${LR:-1e-3}
QAT_LR=${QAT_LR:-1e-4}
mkdir -p "$OUT"
[[ $DEVICE == cpu ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
time $P datagen --out $OUT/data --scenes $SCENES --val-scenes $VAL_SCENES --threads $THREADS --samples-per-pixel 1
C="--config configs/bev_tiny.yaml $MODEL experiment.output_dir=$OUT data.path=$OUT/data train.device=$DEVICE
   data.batch_size=$BATCH train.log_every=50 precision.mode=$PRECISION"
time $P train $C experiment.name=fp32 train.steps=$STEPS train.eval_every=$STEPS optim.lr=$LR
time $P train $C experiment.name=ptq train.load_from=$OUT/fp32 qat.enabled=true qat.mode=ptq qat.calib_batches=8
time $P train $C experiment.name=qat train.load_from=$OUT/fp32 qat.enabled=true qat.mode=qat qat.calib_batches=8 \
  train.steps=$QAT_STEPS train.eval_every=$QAT_STEPS optim.lr=$QAT_LR
# The fp32 model trained as many more steps, for an equal-steps comparison with QAT.
time $P train $C experiment.name=fp32_more train.load_from=$OUT/fp32 train.steps=$QAT_STEPS \
  train.eval_every=$QAT_STEPS optim.lr=$QAT_LR
# The automated mixed-precision sweep (parallax quantize): INT8 within BUDGET_MAP points of mAP.
time $P quantize --run $OUT/fp32 --budget-map ${BUDGET_MAP:-0.5} qat.calib_batches=8 \
  || echo "quantize: the budget was not met (see $OUT/fp32_int8_sweep/quantize_sweep.json)"
for r in fp32 ptq qat fp32_more fp32_int8; do
  echo "$r: $(grep '"kind": "eval"' $OUT/$r/metrics.jsonl | tail -n 1)"
done
echo ALLDONE
