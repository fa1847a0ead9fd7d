#!/usr/bin/env bash
# FP8 training on one Hopper GPU (issue 39), both sides in one command: Parallax
# precision.mode=fp8 (current scaling, and delayed with --delayed) against Parallax bf16, and PyTorch
# torch.compile bf16 and torch.compile + torchao float8 (convert_to_float8_training on the same
# layers: the ViT blocks' qkv, proj, fc1, fc2; bench/train/torch_{vit,bev}_ref.py --float8).
# Workloads: w1 (ViT-B/16, batch 128), bev_large (bev/large, batch BEV_BATCH, default 8), bev_3b
# (bev/3b, batch 2; Parallax only: its PyTorch mirror is not compiled at this size here). Prints one
# JSON line per run; Parallax's is the median of its logged intervals after the first. --graph (w1):
# also every Parallax run with train.cuda_graph=true, and torch.compile(mode="reduce-overhead"), the
# PyTorch side's CUDA graphs.
#   bench/train/fp8_compare.sh [--delayed] [--graph] [--parallax-only] [w1] [bev_large] [bev_3b]
# torchao must be importable (scripts/gpu_build.sh installs a carried wheel from .debs/).
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUILD=${PARALLAX_BUILD_DIR:-build-gpu}
OUTDIR=${OUTDIR:-/tmp/parallax_fp8}
BEV_BATCH=${BEV_BATCH:-8}
DELAYED=0
GRAPH=0
TORCH=1
WORK=()
for a in "$@"; do
  case "$a" in
    --delayed) DELAYED=1 ;;
    --graph) GRAPH=1 ;;
    --parallax-only) TORCH=0 ;;
    w1|bev_large|bev_3b) WORK+=("$a") ;;
    *) echo "fp8_compare: unknown argument $a" >&2; exit 2 ;;
  esac
done
[[ ${#WORK[@]} -gt 0 ]] || WORK=(w1 bev_large bev_3b)
mkdir -p "$OUTDIR"
parallax() {  # run name, workload label, batch, overrides...
  local name=$1 label=$2 batch=$3
  shift 3
  rm -rf "${OUTDIR:?}/$name"
  "$BUILD/bin/parallax" train "experiment.output_dir=$OUTDIR" "experiment.name=$name" "$@" \
    > "$OUTDIR.log_$name" 2>&1 || { tail -20 "$OUTDIR.log_$name"; exit 1; }
  python3 - "$OUTDIR/$name" "$name" "$label" "$batch" <<'PY'
import json, statistics, sys
run, name, label, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rows = [json.loads(l) for l in open(run + "/metrics.jsonl") if '"train"' in l]
rows = rows[1:] or rows  # the first interval holds the warm-up
ms = statistics.median(r["step_ms"] for r in rows)
mfu = statistics.median(r["mfu"] for r in rows)
print(json.dumps({"impl": "parallax-" + name.split("_")[-1], "workload": label, "gpus": 1, "batch_per_gpu": batch,
                  "step_ms": round(ms, 2), "img_per_s": round(batch * 1000 / ms, 1),
                  "bf16_equiv_tflops": round(mfu * 989, 1), "peak_mem_gb": round(rows[-1]["mem_gb"], 2),
                  "last_loss": round(rows[-1]["loss"], 4)}), flush=True)
PY
}
gflops_of() {  # parallax log, model label
  sed -n "s|.*model $2: [0-9.]* M parameters, \([0-9.]*\) GFLOP forward per sample.*|\1|p" "$1" | head -1
}
for w in "${WORK[@]}"; do
  case "$w" in
    w1)
      W1=(--config configs/bench/w1_vit_b16.yaml)
      parallax w1_bf16 "W1 vit_b16" 128 "${W1[@]}"
      parallax w1_fp8 "W1 vit_b16" 128 "${W1[@]}" precision.mode=fp8
      if ((DELAYED)); then parallax w1_fp8delayed "W1 vit_b16" 128 "${W1[@]}" precision.mode=fp8 precision.fp8.recipe=delayed; fi
      if ((TORCH)); then
        python3 bench/train/torch_vit_ref.py --batch 128 --mode compile
        python3 bench/train/torch_vit_ref.py --batch 128 --mode compile --float8
      fi
      if ((GRAPH)); then
        parallax w1_bf16graph "W1 vit_b16" 128 "${W1[@]}" train.cuda_graph=true
        parallax w1_fp8graph "W1 vit_b16" 128 "${W1[@]}" precision.mode=fp8 train.cuda_graph=true
        if ((DELAYED)); then parallax w1_fp8delayedgraph "W1 vit_b16" 128 "${W1[@]}" precision.mode=fp8 precision.fp8.recipe=delayed train.cuda_graph=true; fi
        if ((TORCH)); then python3 bench/train/torch_vit_ref.py --batch 128 --mode compile-graphs; fi
      fi
      ;;
    bev_large)
      BL=(--config configs/bench/w2_bev_base.yaml model.size=large "data.batch_size=$BEV_BATCH")
      parallax bevl_bf16 "bev_large" "$BEV_BATCH" "${BL[@]}"
      parallax bevl_fp8 "bev_large" "$BEV_BATCH" "${BL[@]}" precision.mode=fp8
      if ((DELAYED)); then parallax bevl_fp8delayed "bev_large" "$BEV_BATCH" "${BL[@]}" precision.mode=fp8 precision.fp8.recipe=delayed; fi
      G=$(gflops_of "$OUTDIR.log_bevl_bf16" bev/large)
      REF=(bench/train/torch_bev_ref.py --size large --scene benchmark --batch "$BEV_BATCH" --fwd-gflops-per-sample "$G")
      if ((TORCH)); then
        python3 "${REF[@]}" --mode compile
        python3 "${REF[@]}" --mode compile --float8
      fi
      ;;
    bev_3b)
      B3=(--config configs/bench/w2_bev_base.yaml model.size=3b data.batch_size=2)
      parallax bev3b_bf16 "bev_3b" 2 "${B3[@]}"
      parallax bev3b_fp8 "bev_3b" 2 "${B3[@]}" precision.mode=fp8
      if ((DELAYED)); then parallax bev3b_fp8delayed "bev_3b" 2 "${B3[@]}" precision.mode=fp8 precision.fp8.recipe=delayed; fi
      ;;
  esac
done
