#!/usr/bin/env bash
# fp32 against PTQ and QAT INT8, and the mixed-precision sweep (docs/PERFORMANCE.md, "Quantization").
# Run from the repository root.
#   bench/train/qat_compare.sh                     # bev_tiny on the CPU (the recorded CPU numbers)
#   MODEL="model.size=base model.backbone=vit" DEVICE=cuda BATCH=8 STEPS=1500 QAT_STEPS=300 \
#     SCENES=400 VAL_SCENES=50 THREADS=0 PRECISION=bf16 LR=3e-4 QAT_LR=3e-5 \
#     bench/train/qat_compare.sh                   # bev base on one GPU
#   MODEL="model.backbone=vit" QAT_EXTRA="qat.attention=true" DEVICE=cuda BATCH=8 STEPS=2000 \
#     QAT_STEPS=300 SCENES=400 VAL_SCENES=64 THREADS=16 SWEEP=0 \
#     bench/train/qat_compare.sh                   # INT8 attention at 128 x 224, one GPU
#   ... the same with HEIGHT=256 WIDTH=704 SEED=7  # at nuScenes' 256 x 704: the case that hurts
#   ... then, on the same OUT, VARIANT=_lsq QAT_EXTRA="qat.attention=true qat.learn_scales=true"
#     (VARIANT names the ptq/qat runs, so variants share the fp32 model and its fp32_more)
# The QAT fine-tune and PTQ start from the fp32 run; every run evaluates on the same val scenes.
# QAT_EXTRA: overrides for the PTQ, QAT and quantize runs; when set, ptq_base is PTQ without them.
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
HEIGHT=${HEIGHT:-128}
WIDTH=${WIDTH:-224}
SEED=${SEED:-42}
VARIANT=${VARIANT:-}
mkdir -p "$OUT"
[[ $DEVICE == cpu ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# Resumable: a run whose metrics.jsonl holds an eval row, and a finished dataset, are kept.
done_run() { grep -q '"kind": "eval"' "$OUT/$1/metrics.jsonl" 2>/dev/null || { rm -rf "${OUT:?}/$1"; false; }; }
[[ -f $OUT/data/.done ]] || { time $P datagen --out $OUT/data --scenes $SCENES --val-scenes $VAL_SCENES --height $HEIGHT --width $WIDTH --threads $THREADS --samples-per-pixel 1 && touch $OUT/data/.done; }
C="--config configs/bev_tiny.yaml $MODEL experiment.output_dir=$OUT data.path=$OUT/data train.device=$DEVICE
   data.batch_size=$BATCH data.num_workers=${WORKERS:-1} train.log_every=50 precision.mode=$PRECISION
   experiment.seed=$SEED"
done_run fp32 || time $P train $C experiment.name=fp32 train.steps=$STEPS train.eval_every=$STEPS optim.lr=$LR
QAT_EXTRA=${QAT_EXTRA:-}
RUNS="fp32 ptq$VARIANT qat$VARIANT fp32_more"
if [[ -n $QAT_EXTRA ]]; then
  done_run ptq_base || time $P train $C experiment.name=ptq_base train.load_from=$OUT/fp32 qat.enabled=true qat.mode=ptq \
    qat.calib_batches=8
  RUNS="$RUNS ptq_base"
fi
done_run ptq$VARIANT || time $P train $C experiment.name=ptq$VARIANT train.load_from=$OUT/fp32 qat.enabled=true qat.mode=ptq qat.calib_batches=8 \
  $QAT_EXTRA
done_run qat$VARIANT || time $P train $C experiment.name=qat$VARIANT train.load_from=$OUT/fp32 qat.enabled=true qat.mode=qat qat.calib_batches=8 \
  train.steps=$QAT_STEPS train.eval_every=$QAT_STEPS optim.lr=$QAT_LR $QAT_EXTRA
# The fp32 model trained as many more steps, for an equal-steps comparison with QAT.
done_run fp32_more || time $P train $C experiment.name=fp32_more train.load_from=$OUT/fp32 train.steps=$QAT_STEPS \
  train.eval_every=$QAT_STEPS optim.lr=$QAT_LR
# The automated mixed-precision sweep (parallax quantize): INT8 within BUDGET_MAP points of mAP.
if [[ ${SWEEP:-1} != 0 ]]; then
  time $P quantize --run $OUT/fp32 --budget-map ${BUDGET_MAP:-0.5} qat.calib_batches=8 $QAT_EXTRA \
    || echo "quantize: the budget was not met (see $OUT/fp32_int8_sweep/quantize_sweep.json)"
  RUNS="$RUNS fp32_int8"
fi
for r in $RUNS; do
  echo "$r: $(grep '"kind": "eval"' $OUT/$r/metrics.jsonl | tail -n 1)"
done
echo ALLDONE
