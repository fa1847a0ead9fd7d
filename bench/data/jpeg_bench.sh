#!/usr/bin/env bash
# Issue 38's decode row: camera JPEGs of the synthetic generator at nuScenes' size (6 x 900 x 1600,
# quality 95), decoded on one thread by Parallax (libjpeg-turbo, data/jpeg.h) and by Pillow, at full
# size and with DCT scaling 1/2, 1/4, 1/8, in one run. JSON lines on stdout.
#   bench/data/jpeg_bench.sh [BUILD_DIR] (default build); SCENES=4 HEIGHT=900 WIDTH=1600 QUALITY=95
set -euo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build}
OUT=$(mktemp -d /tmp/parallax_jpeg_bench.XXXXXX)
trap 'rm -rf "$OUT"' EXIT
echo "{\"machine\": \"$(lscpu | sed -n 's/^Model name: *//p')\", \"date\": \"$(date -u +%FT%TZ)\"}"
OMP_NUM_THREADS=1 "$B/bin/data_bench" jpeg --out "$OUT" --scenes "${SCENES:-4}" --height "${HEIGHT:-900}" \
  --width "${WIDTH:-1600}" --quality "${QUALITY:-95}"
python3 bench/data/jpeg_decode.py "$OUT"
