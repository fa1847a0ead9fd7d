#!/usr/bin/env python3
"""Plots a run's metrics.jsonl into runs/<name>/plots/*.png (loss, lr, throughput, and any eval
metric). Usage: tools/plot_metrics.py runs/<name> [--out DIR]."""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"plot_metrics: error: {path}:{n}: not JSON ({e})")
    return rows


def series(rows, kind, key):
    pts = [(r["step"], r[key]) for r in rows if r.get("kind") == kind and r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(rows, kind, keys, title, out, logy=False):
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for key in keys:
        x, y = series(rows, kind, key)
        if x:
            ax.plot(x, y, label=key)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_title(title)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("run")
    ap.add_argument("--out")
    a = ap.parse_args()
    path = os.path.join(a.run, "metrics.jsonl")
    if not os.path.exists(path):
        sys.exit(f"plot_metrics: error: '{path}' not found")
    rows = load(path)
    out = a.out or os.path.join(a.run, "plots")
    os.makedirs(out, exist_ok=True)
    train_keys = sorted({k for r in rows if r.get("kind") == "train" for k in r})
    loss_keys = [k for k in train_keys if k == "loss" or k.startswith("loss_")]
    eval_keys = sorted({k for r in rows if r.get("kind") == "eval" for k in r} - {"kind", "step", "eval_s"})
    seg_keys = [k for k in eval_keys if k == "miou" or k.startswith("iou_")]
    det_keys = [k for k in eval_keys if k.startswith("map") or k.startswith("ap_")]
    other_keys = [k for k in eval_keys if k not in seg_keys and k not in det_keys]
    made = [
        plot(rows, "train", loss_keys, "training loss", os.path.join(out, "loss.png"), logy=True),
        plot(rows, "train", ["lr"], "learning rate", os.path.join(out, "lr.png")),
        plot(rows, "train", ["img_per_s"], "throughput (samples/s)", os.path.join(out, "throughput.png")),
        plot(rows, "eval", seg_keys, "BEV segmentation IoU (val)", os.path.join(out, "eval_bev_iou.png")),
        plot(rows, "eval", det_keys, "detection AP by centre distance (val)", os.path.join(out, "eval_detection.png")),
        plot(rows, "eval", other_keys, "evaluation", os.path.join(out, "eval_loss.png")),
    ]
    for m in made:
        if m:
            print(f"[plot] {m}")


if __name__ == "__main__":
    main()
