#!/usr/bin/env bash
# A fine-tune from imported weights costs nothing per step (issue 60): W2's bev base at
# 6 x 256x704 with the named ViT-B/16 backbone (model.backbone=vit_base_patch16), bf16, batch 16,
# trained from scratch and from a timm ViT-B/16 (random init: the values do not matter to the
# timing) saved with torch.save, alternately, 2 runs each; prints each run's median step_ms after
# the first logged interval. Run after scripts/gpu_build.sh (needs timm in the GPU image's Python).
#   bench/train/pretrained_finetune.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
B=${PARALLAX_BUILD_DIR:-build-gpu}/bin/parallax
T=$(mktemp -d)
python3 -c "
import timm, torch
torch.save(timm.create_model('vit_base_patch16_224', pretrained=False).state_dict(), '$T/vitb16.pt')"
C="--config configs/bench/w2_bev_base.yaml model.backbone=vit_base_patch16 data.batch_size=16 train.steps=40 train.log_every=10 experiment.output_dir=$T"
I="train.load_from=$T/vitb16.pt model.pretrained.source=timm model.pretrained.target=backbone"
for i in 1 2; do
  $B train $C experiment.name=scratch$i > "$T/s$i.log" 2>&1
  $B train $C experiment.name=imported$i $I > "$T/i$i.log" 2>&1
done
grep -A8 "train.load_from" "$T/i1.log" | head -10
python3 - "$T" <<'PY'
import json, os, statistics, sys
t = sys.argv[1]
for name in ("scratch1", "imported1", "scratch2", "imported2"):
    with open(os.path.join(t, name, "metrics.jsonl")) as f:
        ms = [json.loads(l)["step_ms"] for l in f if '"train"' in l][1:]
    print(json.dumps({"run": name, "step_ms": round(statistics.median(ms), 1),
                      "intervals": [round(x, 1) for x in ms]}))
PY
