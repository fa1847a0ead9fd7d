#!/usr/bin/env bash
# Installs what Parallax needs and is missing; does nothing for what is present (idempotent).
# Prints every action. Works on Debian 12 (apt + PyPI) and on machines without network where
# everything is already installed (it then only checks).
set -euo pipefail

PY=${PARALLAX_PYTHON:-python3}
APT_PKGS=(cmake ninja-build g++ ccache libopenmpi-dev openmpi-bin libhdf5-dev libfmt-dev libyaml-cpp-dev
          libgtest-dev libonnx-dev libprotobuf-dev protobuf-compiler clang-format libgloo-dev
          libturbojpeg0-dev nlohmann-json3-dev)
# module name -> pip requirement
declare -A PY_PKGS=([torch]="torch==2.13.0" [numpy]="numpy" [h5py]="h5py" [onnx]="onnx"
                    [onnxruntime]="onnxruntime" [matplotlib]="matplotlib" [PIL]="pillow" [yaml]="pyyaml"
                    [tensorboard]="tensorboard" [safetensors]="safetensors")

say() { echo "[setup] $*"; }

missing_apt=()
if command -v dpkg-query >/dev/null; then
  for p in "${APT_PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
      missing_apt+=("$p")
    fi
  done
fi
if ((${#missing_apt[@]})); then
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  say "installing Debian packages: ${missing_apt[*]}"
  if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing_apt[@]}" >/tmp/parallax_apt.log 2>&1; then
    say "apt-get install failed; running apt-get update and retrying"
    $SUDO apt-get update -q >/tmp/parallax_apt.log 2>&1 || true
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing_apt[@]}" >>/tmp/parallax_apt.log 2>&1 || {
      cat /tmp/parallax_apt.log; say "error: could not install ${missing_apt[*]}"; exit 1; }
  fi
else
  say "Debian packages: all present"
fi

missing_py=()
for mod in "${!PY_PKGS[@]}"; do
  if ! "$PY" -c "import $mod" >/dev/null 2>&1; then missing_py+=("${PY_PKGS[$mod]}"); fi
done
if ((${#missing_py[@]})); then
  say "installing Python packages: ${missing_py[*]}"
  "$PY" -m pip install -q --disable-pip-version-check "${missing_py[@]}" 2>&1 | grep -v -e "Running pip as the 'root'" -e "WARNING: Location" || true
  for mod in "${!PY_PKGS[@]}"; do
    "$PY" -c "import $mod" >/dev/null 2>&1 || { say "error: Python module '$mod' still missing"; exit 1; }
  done
else
  say "Python packages: all present"
fi
say "LibTorch: $("$PY" -c 'import torch; print(torch.__version__, torch.utils.cmake_prefix_path)')"

# nuscenes-devkit, in its own venv (it pins numpy < 2, which the main environment does not hold):
# tests/data/test_nuscenes.py checks that the devkit reads `datagen --layout nuscenes`' folders.
# Without network (the GPU image) it is left out and that one test says it skipped.
NUSC_VENV=${PARALLAX_NUSCENES_VENV:-$HOME/.cache/parallax/nuscenes-venv}
if "$NUSC_VENV/bin/python3" -c "import nuscenes" >/dev/null 2>&1; then
  say "nuscenes-devkit: present ($NUSC_VENV)"
else
  say "installing nuscenes-devkit into $NUSC_VENV"
  if ! { "$PY" -m venv "$NUSC_VENV" && "$NUSC_VENV/bin/pip" install -q --disable-pip-version-check \
           nuscenes-devkit; } >/tmp/parallax_nuscenes_venv.log 2>&1; then
    say "warning: could not install nuscenes-devkit (see /tmp/parallax_nuscenes_venv.log); the devkit check of tests/data/test_nuscenes.py will skip"
  fi
fi

# The PyTorch bridge's other side (issue 60; tests/train/test_pretrained.py): torch, torchvision,
# timm, transformers and safetensors in their own venv, because PyPI's torchvision cannot import
# beside the CPU torch whose LibTorch Parallax builds against, and timm needs torchvision. The
# tests make timm / torchvision / transformers models there and compare Parallax's backbones with
# them. About 5.5 GB (a CUDA build of torch; it runs on the CPU).
BRIDGE_VENV=${PARALLAX_BRIDGE_VENV:-$HOME/.cache/parallax/bridge-venv}
if "$BRIDGE_VENV/bin/python3" -c "import torch, torchvision, timm, safetensors, transformers" >/dev/null 2>&1; then
  say "PyTorch bridge venv: present ($BRIDGE_VENV)"
else
  say "installing torch, torchvision, timm, transformers, safetensors into $BRIDGE_VENV"
  if ! { "$PY" -m venv "$BRIDGE_VENV" && "$BRIDGE_VENV/bin/pip" install -q --disable-pip-version-check \
           torch==2.14.1 torchvision==0.29.1 timm transformers safetensors numpy; } >/tmp/parallax_bridge_venv.log 2>&1; then
    say "error: could not install the PyTorch bridge venv (see /tmp/parallax_bridge_venv.log)"
    exit 1
  fi
fi
