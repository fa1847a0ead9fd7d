#!/usr/bin/env python3
"""TensorBoard sidecar: tails runs/<name>/metrics.jsonl and writes every numeric field as a
TensorBoard scalar (tag "<kind>/<field>", e.g. "train/loss", "eval/miou") into runs/<name>/tb.

  tools/tb_sidecar.py runs/<name>            # follow until the run writes its summary record
  tools/tb_sidecar.py runs/<name> --once     # convert what is there and exit
  tensorboard --logdir runs/<name>/tb        # view (live while following)

The trainer itself stays free of Python: this process only reads the JSONL file, so it can be
started before, during or after training, and restarted at any time (it rewrites from the start).
"""
import argparse
import json
import os
import sys
import time


def writer_for(logdir):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # tensorboard missing
        sys.exit(f"tb_sidecar: error: {e}; install it with 'pip install tensorboard'")
    return SummaryWriter(log_dir=logdir, purge_step=0)


def emit(writer, rec):
    kind = rec.get("kind", "train")
    step = rec.get("step")
    if step is None:
        return
    for k, v in rec.items():
        if k in ("kind", "step") or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        writer.add_scalar(f"{kind}/{k}", v, step)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run")
    ap.add_argument("--once", action="store_true", help="convert and exit instead of following")
    ap.add_argument("--poll", type=float, default=2.0, help="seconds between checks when following")
    ap.add_argument("--out", help="event folder (default: <run>/tb)")
    a = ap.parse_args()
    path = os.path.join(a.run, "metrics.jsonl")
    writer = writer_for(a.out or os.path.join(a.run, "tb"))
    pos, buf, done, lines = 0, "", False, 0
    while True:
        if os.path.exists(path):
            with open(path) as f:
                f.seek(pos)
                chunk = f.read()
                pos = f.tell()
            buf += chunk
            *complete, buf = buf.split("\n")
            for line in complete:
                if not line.strip():
                    continue
                rec = json.loads(line)
                emit(writer, rec)
                lines += 1
                done = done or rec.get("kind") == "summary"
            writer.flush()
        if a.once or done:
            break
        time.sleep(a.poll)
    writer.close()
    print(f"[tb_sidecar] {lines} records -> {a.out or os.path.join(a.run, 'tb')}")


if __name__ == "__main__":
    main()
