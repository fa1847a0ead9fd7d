#!/usr/bin/env python3
"""Writes the official nuScenes scene splits as the --splits file of `parallax convert nuscenes`
({"train": [scene names], "val": [...]}), from an installed nuscenes-devkit (`pip install
nuscenes-devkit`; scripts/setup.sh puts one in ~/.cache/parallax/nuscenes-venv).

    ~/.cache/parallax/nuscenes-venv/bin/python3 tools/nuscenes_splits.py --version v1.0-trainval > splits.json

v1.0-trainval gives train (700 scenes) and val (150); v1.0-mini gives its mini_train and mini_val
as train and val; v1.0-test gives test.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="v1.0-trainval", choices=["v1.0-trainval", "v1.0-mini", "v1.0-test"])
    args = ap.parse_args()
    try:
        from nuscenes.utils.splits import create_splits_scenes
    except ImportError:
        sys.exit("nuscenes_splits: nuscenes-devkit is not installed in this Python (pip install nuscenes-devkit)")
    s = create_splits_scenes(verbose=False)
    wanted = {"v1.0-trainval": {"train": "train", "val": "val"},
              "v1.0-mini": {"train": "mini_train", "val": "mini_val"},
              "v1.0-test": {"test": "test"}}[args.version]
    json.dump({ours: sorted(s[theirs]) for ours, theirs in wanted.items()}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
