#!/usr/bin/env bash
# The README's demo command: installs what is missing, builds, and runs the main job on the
# embedded default (synthetic data, CPU). Prints where the run's outputs are.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
BUILD=${PARALLAX_BUILD_DIR:-build}
CONFIG=${PARALLAX_DEMO_CONFIG:-configs/mlp_demo.yaml}
"$BUILD/bin/parallax" train --config "$CONFIG" "$@"
RUN=$("$BUILD/bin/parallax" train --config "$CONFIG" "$@" --print-config | python3 -c \
  'import sys, yaml; c = yaml.safe_load(sys.stdin); print(c["experiment"]["output_dir"] + "/" + c["experiment"]["name"])')
python3 tools/plot_metrics.py "$RUN"
echo
echo "[demo] run directory: $RUN"
echo "[demo]   resolved config: $RUN/config.yaml"
echo "[demo]   metrics:         $RUN/metrics.jsonl"
echo "[demo]   plots:           $RUN/plots/"
