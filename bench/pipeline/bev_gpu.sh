#!/usr/bin/env bash
# Issue 36's bev/large rows: the perception model (configs/bench/w2_bev_base.yaml with
# model.size=large: bf16 autocast, fused AdamW, synthetic batches) on 2 GPUs of one node, DDP against
# a 2-stage pipeline under every schedule, all at the same global batch (GLOBAL, 16 by default), in
# one command:
#   - DDP: GLOBAL / 2 samples per rank, one micro-step;
#   - pp 2 under gpipe, 1f1b, interleaved (2 virtual stages) and zb, for each micro-batch size in
#     MICRO_SIZES ("2 4": 2 x 8 and 4 x 4 micro-batches).
# Every run trains STEPS steps, logging every LOG steps; step_ms is the median of the logged
# intervals between the first (warm-up) and the last (the profiled one). The pipeline runs profile
# their last PROFILE steps (train.profile_steps) and bench/train/trace_summary.py --bubble reads each
# rank's trace: bubble = (span - non-NCCL kernel time) / non-NCCL kernel time per step, against the
# schedule's formula ((p - 1) / m for gpipe and 1f1b, (p - 1) / (v m) interleaved, zb's from
# the plan). One JSON line per run (samples_per_s, ratio to DDP, bubble per rank), then a table.
#   bench/pipeline/bev_gpu.sh                      # after scripts/gpu_build.sh
# Environment: BIN (build-gpu/bin/parallax), GLOBAL (16), MICRO_SIZES ("2 4"), STEPS (25), LOG (5),
# PROFILE (3), SCHEDULES ("gpipe 1f1b interleaved zb"), OUTDIR (/tmp/parallax_pp_bev), MPIRUN.
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
BIN=${BIN:-build-gpu/bin/parallax}
MPIRUN=${MPIRUN:-mpirun}
GLOBAL=${GLOBAL:-16} MICRO_SIZES=${MICRO_SIZES:-"2 4"} STEPS=${STEPS:-25} LOG=${LOG:-5} PROFILE=${PROFILE:-3}
SCHEDULES=${SCHEDULES:-"gpipe 1f1b interleaved zb"}
OUTDIR=${OUTDIR:-/tmp/parallax_pp_bev}
mkdir -p "$OUTDIR"
JSONL=$OUTDIR/pp_bev.jsonl
: > "$JSONL"
[[ -x "$BIN" ]] || { echo "bev_gpu: no $BIN (run scripts/gpu_build.sh first)" >&2; exit 1; }
echo "[bev_gpu] $(date -u +%Y-%m-%dT%H:%M:%SZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
COMMON=(--config configs/bench/w2_bev_base.yaml model.size=large "train.steps=$STEPS" "train.log_every=$LOG"
        parallel.timeout_s=120 "experiment.output_dir=$OUTDIR/runs")

run() {  # name, then overrides; prints the run's JSON line
  local name=$1
  shift
  local t0=$SECONDS
  if ! timeout 600 "$MPIRUN" --oversubscribe --bind-to none -np 2 "$BIN" train "${COMMON[@]}" \
      "experiment.name=$name" "$@" > "$OUTDIR/$name.log" 2>&1; then
    echo "{\"run\": \"$name\", \"error\": \"rc $? after $((SECONDS - t0)) s; see $OUTDIR/$name.log\"}" | tee -a "$JSONL"
    grep -m3 "parallax: error" "$OUTDIR/$name.log" >&2 || tail -5 "$OUTDIR/$name.log" >&2
    return 0
  fi
  python3 - "$OUTDIR/runs/$name" "$name" "$((SECONDS - t0))" "$@" <<'PY' | tee -a "$JSONL"
import glob, json, os, re, statistics, subprocess, sys
run, name, wall = sys.argv[1], sys.argv[2], int(sys.argv[3])
ov = dict(a.split("=", 1) for a in sys.argv[4:])
rows = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl")) if '"train"' in l]
prof = int(ov.get("train.profile_steps", 0))
timed = rows[1:-1] if prof and len(rows) > 2 else rows[1:] or rows
ms = statistics.median(r["step_ms"] for r in timed)
batch, micro = int(ov["data.batch_size"]), int(ov.get("train.grad_accum", 1))
pp = int(ov.get("parallel.pp", 1))
world = 2
samples = batch * micro * (world // pp)
out = {"run": name, "schedule": ov.get("parallel.pp_schedule", "ddp"), "pp": pp, "micro_batch": batch,
       "micro_batches": micro, "global_batch": samples, "step_ms": round(ms, 1),
       "samples_per_s": round(samples * 1000 / ms, 2), "peak_mem_gb": round(rows[-1].get("mem_gb", 0), 1),
       "wall_s": wall}
if prof:
    bubbles = []
    for r in range(world):
        trace = os.path.join(run, "profile", f"trace_rank{r}.json")
        p = subprocess.run([sys.executable, "bench/train/trace_summary.py", trace, "--steps", str(prof), "--bubble",
                            "--top", "0"], capture_output=True, text=True)
        m = re.search(r"compute \(non-NCCL.*?\) ([\d.]+) ms/step", p.stdout)
        b = re.search(r"^bubble ([\d.]+)$", p.stdout, re.M)
        bubbles.append({"rank": r, "compute_ms": float(m.group(1)) if m else None,
                        "bubble": float(b.group(1)) if b else None, **({"error": p.stderr[-300:]} if not b else {})})
    out["bubble_per_rank"] = bubbles
    known = [b for b in bubbles if b["compute_ms"] is not None]
    if known:
        out["bubble_trace"] = max(known, key=lambda b: b["compute_ms"])["bubble"]
print(json.dumps(out))
PY
}

run ddp "data.batch_size=$((GLOBAL / 2))" train.grad_accum=1
for b in $MICRO_SIZES; do
  for s in $SCHEDULES; do
    extra=()
    [[ $s == interleaved ]] && extra=(parallel.pp_virtual_stages=2)
    run "pp2_${s}_b$b" "data.batch_size=$b" "train.grad_accum=$((GLOBAL / b))" parallel.pp=2 "parallel.pp_schedule=$s" \
      "train.profile_steps=$PROFILE" "train.profile_start=$((STEPS - PROFILE + 1))" "${extra[@]}"
  done
done

python3 - "$JSONL" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ddp = next((r for r in rows if r.get("run") == "ddp" and "step_ms" in r), None)
print("\n| run | micro-batches | step ms | samples/s | vs DDP | bubble (trace, busiest rank) | formula |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    if "error" in r:
        print(f"| {r['run']} | | | | | {r['error']} | |")
        continue
    m, pp = r["micro_batches"], r["pp"]
    formula = {"gpipe": (pp - 1) / m, "1f1b": (pp - 1) / m, "interleaved": (pp - 1) / (2 * m),
               "zb": (pp - 1) / (3 * m)}.get(r["schedule"])
    ratio = f"{r['samples_per_s'] / ddp['samples_per_s']:.3f}" if ddp else ""
    bub = r.get("bubble_trace")
    print(f"| {r['run']} | {r['micro_batch']} x {m} | {r['step_ms']} | {r['samples_per_s']} | {ratio} | "
          f"{'' if bub is None else f'{bub:.3f}'} | {'' if formula is None else f'{formula:.3f}'} |")
PY
