#!/usr/bin/env bash
# Distillation against the student alone (docs/PERFORMANCE.md, "Distillation"; issue 40): a bev_tiny
# student (conv backbone) trained STUDENT_STEPS alone and distilled, at equal steps, from a teacher
# that is clearly stronger (bev_tiny with the ViT backbone trained TEACHER_STEPS), each over SEEDS,
# every run evaluated on the same VAL_SCENES validation scenes. VARIANTS names the distillation
# settings compared (each a name=overrides pair, see below); the student alone is always run.
# Prints one line per run and, per setting, the mean and the spread (max - min) over the seeds of
# mIoU and mAP. Reruns skip runs whose metrics already hold an eval row (so a long comparison can
# be split over calls).
#   bench/train/distill_compare.sh                     # CPU (slow: ~1.5 steps/s on 2 cores)
#   DEVICE=cuda THREADS=16 bench/train/distill_compare.sh
#   STUDENT=model.backbone=vit OUT=/tmp/dvit DEVICE=cuda THREADS=16 VARIANTS=defaults: \
#     bench/train/distill_compare.sh                   # the teacher's architecture, trained shorter
# STUDENT: overrides (comma-separated) of the student, alone and distilled (default: none, the
# conv backbone).
set -euo pipefail
cd "$(dirname "$0")/../.."
P=${PARALLAX:-build/bin/parallax}
OUT=${OUT:-/tmp/distill_cmp}
DEVICE=${DEVICE:-cpu}
THREADS=${THREADS:-2}
SCENES=${SCENES:-200}
VAL_SCENES=${VAL_SCENES:-64}
TEACHER_STEPS=${TEACHER_STEPS:-2000}
STUDENT_STEPS=${STUDENT_STEPS:-300}
SEEDS=${SEEDS:-1 2 3}
IFS=',' read -ra STUDENT_OV <<< "${STUDENT:-}"
# name:overrides (overrides comma-separated): the table of docs/PERFORMANCE.md. "old" is the
# defaults before issue 40 (the KL over BEV cells on, raw features, no adapter at equal widths);
# "defaults" the current ones.
VARIANTS=${VARIANTS:-"old:distill.seg_kl=1,distill.feature_norm=none,distill.adapter=auto t1:distill.seg_kl=1,distill.temperature=1 feature_ad:distill.heatmap=0 feat3:distill.heatmap=0,distill.feature=3 hm10:distill.heatmap=10,distill.feature=0 hm10_feat:distill.heatmap=10 defaults:"}
mkdir -p "$OUT"
[[ $DEVICE == cpu ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
[ -f "$OUT/data/.done" ] || {
  rm -rf "$OUT/data"
  $P datagen --out "$OUT/data" --scenes "$SCENES" --val-scenes "$VAL_SCENES" --threads "$THREADS" --samples-per-pixel 1 > "$OUT/datagen.log" 2>&1
  touch "$OUT/data/.done"
}
C=(--config configs/bev_tiny.yaml "experiment.output_dir=$OUT" "data.path=$OUT/data" "train.device=$DEVICE"
   data.batch_size=4 train.log_every=50)
done_run() { [ -f "$OUT/$1/metrics.jsonl" ] && grep -q '"kind": "eval"' "$OUT/$1/metrics.jsonl"; }
train() {  # name, overrides...
  local n=$1; shift
  done_run "$n" && return 0
  rm -rf "${OUT:?}/$n"
  local s=$SECONDS
  $P train "${C[@]}" "experiment.name=$n" "$@" > "$OUT/$n.log" 2>&1 || { tail -5 "$OUT/$n.log"; return 1; }
  echo "# $n: $((SECONDS - s)) s" >&2
}
train teacher model.backbone=vit "train.steps=$TEACHER_STEPS" "train.eval_every=$TEACHER_STEPS"
for seed in $SEEDS; do
  train "alone_s$seed" "experiment.seed=$seed" "train.steps=$STUDENT_STEPS" "train.eval_every=$STUDENT_STEPS" \
    ${STUDENT_OV[@]+"${STUDENT_OV[@]}"}
  for v in $VARIANTS; do
    name=${v%%:*}; ov=${v#*:}
    IFS=',' read -ra extra <<< "$ov"
    train "${name}_s$seed" "experiment.seed=$seed" "train.steps=$STUDENT_STEPS" "train.eval_every=$STUDENT_STEPS" \
      "distill.teacher=$OUT/teacher" distill.teacher_backbone=vit ${STUDENT_OV[@]+"${STUDENT_OV[@]}"} \
      ${extra[@]+"${extra[@]}"}
  done
done
python3 - "$OUT" <<'PY'
import json, os, re, statistics, sys
out = sys.argv[1]
def last_eval(run):
    p = os.path.join(out, run, "metrics.jsonl")
    if not os.path.exists(p):
        return None
    rows = [json.loads(l) for l in open(p) if '"kind": "eval"' in l]
    return rows[-1] if rows else None
groups = {}
for run in sorted(os.listdir(out)):
    r = last_eval(run)
    if r is None:
        continue
    print(f"{run:16s} step {r['step']:5d}  mIoU {r['miou']:.4f}  mAP {r['map']:.4f}  NDS {r.get('nds', float('nan')):.4f}  val loss {r['val_loss']:.4f}")
    m = re.match(r"(.*)_s(\d+)$", run)
    if m:
        groups.setdefault(m.group(1), []).append(r)
for g, rows in groups.items():
    mi = [r["miou"] for r in rows]; ma = [r["map"] for r in rows]
    print(f"{g:10s} seeds {len(rows)}  mIoU {statistics.mean(mi):.4f} (spread {max(mi) - min(mi):.4f})  "
          f"mAP {statistics.mean(ma):.4f} (spread {max(ma) - min(ma):.4f})")
PY
