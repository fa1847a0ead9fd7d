#!/usr/bin/env bash
# Issue 24, row 4: the pipeline bubble of every schedule (gpipe, 1f1b, interleaved, zb) measured
# against its formula, Parallax (bench/pipeline/pp_bubble.cpp, mpirun, NCCL) beside
# torch.distributed.pipelining under the matching schedule (bench/pipeline/torch_pp_bubble.py,
# torchrun, NCCL), on GPUS GPUs of one node, the same model (an mlp of pp x v layers of WIDTH),
# ROWS rows per micro-batch and MICRO micro-batches. One JSON line per (side, schedule, GPUS, MICRO);
# the two sides' common fields mean the same (torch_pp_bubble.py's docstring; on a GPU compare
# step_ms and bubble_ideal). Ends with a Markdown table of the lines.
#   bench/pipeline/compare_gpu.sh [GPUS=2] [MICRO=8]          # e.g. bench/pipeline/compare_gpu.sh "2 4" 8
#   bench/pipeline/compare_gpu.sh --cpu [PROCS=2] [MICRO=4]   # CPU smoke run (gloo/MPI), same as DEVICE=cpu
#   bench/pipeline/compare_gpu.sh --compute-bound [GPUS] [MICRO]  # WIDTH 8192, ROWS 4096 by default:
#       a stage's forward is 2 x 4096 x 8192^2 = 0.55 TFLOP per micro-batch and each message
#       128 MiB (fp32), sizes where the bubble and large transfers, not per-message latency, should
#       dominate (not yet run on GPUs)
# GPUS and MICRO may be lists ("2 4", "8 16"). Environment: BIN (default build-gpu/bin/pp_bubble;
# build/bin/pp_bubble with --cpu; the default is (re)built first when its build directory exists,
# so a stale binary without --device cannot run), PYTHON (python3), WIDTH (1024), ROWS (64),
# STEPS (8 timed steps, after 2 warm-up), VIRTUAL (2), SCHEDULES (gpipe,1f1b,interleaved,zb),
# MPIRUN (mpirun), OUTDIR (/tmp/parallax_pp_compare: logs and pp_compare.jsonl).
set -euo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
DEVICE=${DEVICE:-cuda}
if [[ "${1:-}" == "--cpu" ]]; then
  DEVICE=cpu
  shift
fi
if [[ "${1:-}" == "--compute-bound" ]]; then
  WIDTH=${WIDTH:-8192} ROWS=${ROWS:-4096}
  shift
fi
case "$DEVICE" in
  cuda) BUILD=${PARALLAX_BUILD_DIR:-build-gpu}; DEFAULT_MICRO=8 ;;
  cpu) BUILD=${PARALLAX_BUILD_DIR:-build}; DEFAULT_MICRO=4 ;;
  *) echo "compare_gpu: DEVICE=$DEVICE (cpu or cuda)" >&2; exit 2 ;;
esac
GPUS=${1:-2} MICRO=${2:-$DEFAULT_MICRO}
GPUS=${GPUS//,/ } MICRO=${MICRO//,/ }
PY=${PYTHON:-python3}
MPIRUN=${MPIRUN:-mpirun}
WIDTH=${WIDTH:-1024} ROWS=${ROWS:-64} STEPS=${STEPS:-8} VIRTUAL=${VIRTUAL:-2}
SCHEDULES=${SCHEDULES:-gpipe,1f1b,interleaved,zb}
OUTDIR=${OUTDIR:-/tmp/parallax_pp_compare}
mkdir -p "$OUTDIR"
JSONL=$OUTDIR/pp_compare.jsonl
: > "$JSONL"
CORES=$(nproc --all)
# One thread per rank on both sides (pp_bubble sets it itself; torchrun sets OMP_NUM_THREADS=1).
export OMP_NUM_THREADS=1

if [[ -z "${BIN:-}" ]]; then
  BIN=$BUILD/bin/pp_bubble
  if [[ -f "$BUILD/build.ninja" || -f "$BUILD/Makefile" ]]; then
    cmake --build "$BUILD" --target pp_bubble -j "$CORES" > "$OUTDIR/build.log" 2>&1 \
      || { tail -20 "$OUTDIR/build.log"; exit 1; }
  elif [[ "$DEVICE" == cuda ]]; then
    echo "[compare_gpu] no $BUILD: building it (scripts/gpu_build.sh, no tests)" >&2
    PARALLAX_BUILD_DIR=$BUILD scripts/gpu_build.sh -R NONE > "$OUTDIR/build.log" 2>&1 \
      || { tail -20 "$OUTDIR/build.log"; exit 1; }
  fi
fi
[[ -x "$BIN" ]] || { echo "compare_gpu: no $BIN (set BIN, or build $BUILD)" >&2; exit 1; }

if [[ "$DEVICE" == cuda ]]; then
  have=$(nvidia-smi -L | grep -c '^GPU ' || true)
  for g in $GPUS; do
    ((g <= have)) || { echo "compare_gpu: $g GPUs asked, this node has $have" >&2; exit 1; }
  done
  echo "[compare_gpu] $(date -u +%Y-%m-%dT%H:%M:%SZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs); torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  echo "[compare_gpu] $(date -u +%Y-%m-%dT%H:%M:%SZ) CPU smoke run ($CORES cores); torch $("$PY" -c 'import torch; print(torch.__version__)')"
fi

COMMON=(--width "$WIDTH" --rows "$ROWS" --steps "$STEPS" --schedules "$SCHEDULES" --device "$DEVICE")
for g in $GPUS; do
  for m in $MICRO; do
    log=$OUTDIR/parallax_p${g}_m$m.log
    "$MPIRUN" --oversubscribe --bind-to none -np "$g" "$BIN" --micro "$m" --virtual "$VIRTUAL" "${COMMON[@]}" \
      > "$log" 2>&1 || { tail -20 "$log"; exit 1; }
    # An old pp_bubble ignores --device and would have run on the CPU.
    grep -q "\"device\": \"$DEVICE\"" "$log" || {
      echo "compare_gpu: $BIN printed no \"device\": \"$DEVICE\" line (a stale binary?)" >&2
      tail -5 "$log"
      exit 1
    }
    grep '^{' "$log" | tee -a "$JSONL"
    log=$OUTDIR/torch_p${g}_m$m.log
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$g" bench/pipeline/torch_pp_bubble.py \
      --micro "$m" --virtual-stages "$VIRTUAL" "${COMMON[@]}" > "$log" 2>&1 || { tail -20 "$log"; exit 1; }
    grep '^{' "$log" | tee -a "$JSONL"
  done
done

"$PY" - "$JSONL" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
order = ["gpipe", "1f1b", "interleaved", "zb"]
key = lambda r: (r["pp"], r["micro_batches"], order.index(r["schedule"]), r["schedule"])
by = {}
for r in rows:
    by.setdefault(key(r), {})[r["impl"]] = r
print("\n| pp | m | schedule | v | formula | Parallax step ms | torch step ms | torch / Parallax "
      "| Parallax bubble_ideal | torch bubble_ideal | Parallax bottleneck | torch bottleneck |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for (p, m, _, s), d in sorted(by.items()):
    a, b = d.get("parallax"), d.get("torch")
    f = lambda r, k, fmt: format(r[k], fmt) if r else "-"
    ratio = f"{b['step_ms'] / a['step_ms']:.2f}" if a and b else "-"
    any_ = a or b
    print(f"| {p} | {m} | {s} | {any_['virtual_stages']} | {any_['bubble_formula']:.3f} | "
          f"{f(a, 'step_ms', '.2f')} | {f(b, 'step_ms', '.2f')} | {ratio} | "
          f"{f(a, 'bubble_ideal', '.3f')} | {f(b, 'bubble_ideal', '.3f')} | "
          f"{f(a, 'bubble_bottleneck', '.3f')} | {f(b, 'bubble_bottleneck', '.3f')} |")
PY
