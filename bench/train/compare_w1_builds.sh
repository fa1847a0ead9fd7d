#!/usr/bin/env bash
# W1 (ViT-B/16, batch 128, bf16) on 1 GPU with two builds of Parallax, run alternately REPS times,
# so that a change's cost is measured against the build before it on the same GPU in one session.
# Prints one JSON line per run (median step time of the logged intervals after the first).
#   bench/train/compare_w1_builds.sh OLD_BUILD_DIR NEW_BUILD_DIR [REPS] [-- extra overrides]
# e.g. build the previous commit into build-old (git worktree + cmake --target parallax), then
#   bench/train/compare_w1_builds.sh build-old build-gpu 3
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OLD=$1 NEW=$2 REPS=${3:-3}
shift $(( $# >= 3 ? 3 : $# ))
[[ "${1:-}" == "--" ]] && shift
OUTDIR=${OUTDIR:-/tmp/parallax_w1_compare}
run() {  # build dir, run name
  local bin=$1/bin/parallax name=$2
  shift 2
  rm -rf "${OUTDIR:?}/$name"
  "$bin" train --config configs/bench/w1_vit_b16.yaml "experiment.output_dir=$OUTDIR" "experiment.name=$name" "$@" \
    > "$OUTDIR.log_$name" 2>&1 || { tail -5 "$OUTDIR.log_$name"; exit 1; }
  python3 - "$OUTDIR/$name" "$name" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"train"' in l][1:]
print(json.dumps({"run": sys.argv[2], "step_ms": round(statistics.median(r["step_ms"] for r in rows), 2),
                  "intervals": len(rows), "peak_mem_gb": round(rows[-1]["mem_gb"], 2)}), flush=True)
PY
}
mkdir -p "$OUTDIR"
for rep in $(seq 1 "$REPS"); do
  run "$OLD" "old_$rep" "$@"
  run "$NEW" "new_$rep" "$@"
done
