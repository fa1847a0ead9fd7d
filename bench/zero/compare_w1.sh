#!/usr/bin/env bash
# Issue 24, row 2: ZeRO-1/2/3 against DDP and against PyTorch (DDP and FSDP2 `fully_shard`) on W1
# (ViT-B/16, 128 images per GPU, bf16 autocast, fp32 gradients, fused AdamW), both sides in one
# command on GPUS GPUs of one node. One JSON line per run; the Parallax rows come from
# bench/zero/stages_w1.sh (eager: ZeRO refuses CUDA graphs, so DDP runs eager here too).
#   bench/zero/compare_w1.sh [GPUS=2] [REPS=1]
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=${1:-2} REPS=${2:-1}
PY=${PYTHON:-python3}
echo "[compare_w1] $(date -u +%Y-%m-%dT%H:%M:%SZ) $GPUS GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
bench/zero/stages_w1.sh "$GPUS" "$REPS" "0 1 2 3"
for rep in $(seq 1 "$REPS"); do
  for wrap in ddp fsdp2; do
    log=${OUTDIR:-/tmp/parallax_zero_stages}/torch_${wrap}_g${GPUS}_$rep.log
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" bench/train/torch_vit_ref.py \
      --batch 128 --mode eager --wrap "$wrap" > "$log" 2>&1 || { tail -20 "$log"; exit 1; }
    grep '^{' "$log"
  done
done
