#!/usr/bin/env bash
# The README's demo command: installs what is missing, builds the `parallax` binary (only it and
# the libraries it links: the tests are scripts/test.sh's business), generates the synthetic
# multi-camera dataset (once), and trains the tiny BEV model data-parallel on 2 CPU ranks under
# mpirun (configs/bev_tiny.yaml). Extra arguments are config overrides, e.g. train.steps=100.
# Prints where the run's config, metrics, plots and checkpoints are.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh --target parallax
BUILD=${PARALLAX_BUILD_DIR:-build}
BIN="$BUILD/bin/parallax"
CONFIG=${PARALLAX_DEMO_CONFIG:-configs/bev_tiny.yaml}
RANKS=${PARALLAX_DEMO_RANKS:-2}
DATA=$("$BIN" train --config "$CONFIG" "$@" --print-config | python3 -c 'import sys, yaml; print(yaml.safe_load(sys.stdin)["data"]["path"])')
RUN=$("$BIN" train --config "$CONFIG" "$@" --print-config | python3 -c \
  'import sys, yaml; c = yaml.safe_load(sys.stdin); print(c["experiment"]["output_dir"] + "/" + c["experiment"]["name"])')
if [[ ! -f "$DATA/dataset.json" ]]; then
  "$BIN" datagen --out "$DATA"
else
  echo "[demo] dataset $DATA exists; reusing it (delete it to regenerate)"
fi
# mpirun refuses to run as root unless told; the demo may run in a container as root.
if [[ $(id -u) -eq 0 ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
start=$(date +%s)
# train.resume=auto: a second demo continues (or, finished, just reports) the first one's run; the
# trainer refuses to start again from step 0 over a run's checkpoints. An override in "$@" wins.
mpirun --oversubscribe --bind-to none -np "$RANKS" "$BIN" train --config "$CONFIG" train.resume=auto "$@"
echo
echo "[demo] trained in $(( $(date +%s) - start ))s on $RANKS CPU ranks; run directory: $RUN"
echo "[demo]   resolved config: $RUN/config.yaml"
echo "[demo]   metrics:         $RUN/metrics.jsonl   (TensorBoard: python3 tools/tb_sidecar.py $RUN --once; tensorboard --logdir $RUN/tb)"
echo "[demo]   plots:           $RUN/plots/"
echo "[demo]   checkpoints:     $RUN/checkpoints/   (parallax inspect $RUN)"
