#!/usr/bin/env bash
# Import time and peak host memory of a pretrained ViT-L/16 (304 M parameters, timm's names,
# random weights: the values do not matter to the timing) from safetensors and from torch.save:
# Parallax (tests/train/backbone_tool: build the bev model's vit_large_patch16 backbone, then
# load through model.pretrained exactly as `parallax train` does) against PyTorch (timm
# create_model + safetensors.torch.load_file or torch.load + load_state_dict), each in a fresh
# process, 3 runs each, medians. Needs the bridge venv (scripts/setup.sh) and a build with tests.
#   bench/checkpoint/import_bench.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${PARALLAX_BUILD_DIR:-build}
BRIDGE=${PARALLAX_BRIDGE_PYTHON:-$HOME/.cache/parallax/bridge-venv/bin/python3}
RUNS=${1:-3}
DIR=${IMPORT_BENCH_DIR:-/tmp/parallax_import_bench}
mkdir -p "$DIR"
if [[ ! -f "$DIR/model.safetensors" || ! -f "$DIR/model.pt" ]]; then
  "$BRIDGE" tests/train/torch_side.py vit vit_large_patch16_224 224 224 "$DIR" >/dev/null
fi
python3 - "$BUILD/bin/backbone_tool" "$BRIDGE" "$DIR" "$RUNS" <<'PY'
import json, os, resource, statistics, subprocess, sys, time
tool, bridge, d, runs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch_load = r'''
import sys, timm, torch
from safetensors.torch import load_file
m = timm.create_model("vit_large_patch16_224", pretrained=False)
f = sys.argv[1]
sd = load_file(f) if f.endswith(".safetensors") else torch.load(f, map_location="cpu", weights_only=True)
m.load_state_dict(sd, strict=True)
'''
def measure(cmd):
    # Peak RSS of the child alone: a fresh Python that runs it and reads RUSAGE_CHILDREN.
    probe = ("import resource,subprocess,sys,time;t=time.perf_counter();"
             "r=subprocess.run(sys.argv[1:],stdout=subprocess.DEVNULL);"
             "dt=time.perf_counter()-t;"
             "print(r.returncode,dt,resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True).stdout.split()
    assert out[0] == "0", cmd
    return float(out[1]), int(out[2]) / 1024.0
size = {f: os.path.getsize(os.path.join(d, f)) / 1e9 for f in ("model.safetensors", "model.pt")}
for f in ("model.safetensors", "model.pt"):
    path = os.path.join(d, f)
    cases = {
        "parallax": [tool, "--backbone", "vit_large_patch16", "--height", "224", "--width", "224",
                     "--weights", path, "--images", "none", "--out", "none", "--source", "timm"],
        "pytorch": [bridge, "-c", torch_load, path],
    }
    for impl, cmd in cases.items():
        times, peaks = [], []
        for _ in range(runs):
            t, p = measure(cmd)
            times.append(t); peaks.append(p)
        print(json.dumps({"file": f, "GB": round(size[f], 2), "impl": impl,
                          "seconds": round(statistics.median(times), 2),
                          "peak_rss_MB": round(statistics.median(peaks)),
                          "runs": [round(t, 2) for t in times]}))
PY
