#!/usr/bin/env python3
"""Restart latency of `parallax launch` on CPU: from a worker's SIGKILL to the first step the
restarted group trains (issue 22). bev_tiny (conv backbone) on synthetic in-memory batches, 2
workers (gloo), a checkpoint every 5 steps; the kill lands between checkpoints.

Measured: the time from os.kill to the moment metrics.jsonl holds a row of a step after the
restored checkpoint again (the launcher noticing the death, tearing the group down, the store
barrier, two fresh processes loading LibTorch, the rendezvous, the model and the checkpoint load,
then one step). Prints one JSON line per repetition and a summary line with the median.

The same measurement with torchrun (torch.distributed.run --no-python) supervising the same
parallax workers is the PyTorch reference (--launcher torchrun): the workers are identical, only the
supervisor differs.

Usage: restart_latency.py <parallax binary> [--reps N] [--monitor-interval S] [--launcher parallax|torchrun|both]
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(SRC, "tests", "launch"))
from test_launch import children, env_of, rows  # noqa: E402


def one(parallax, d, rep, interval, launcher):
    name = f"{launcher}{rep}"
    if launcher == "parallax":
        sup = [parallax, "launch", "--nproc-per-node", "2", "--standalone", "--max-restarts", "1",
               "--grace-period", "5", "--monitor-interval", str(interval), "--", "train"]
    else:
        sup = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               "--max-restarts", "1", "--monitor-interval", str(interval), "--no-python", parallax, "train",
               "train.resume=auto"]
    cmd = [*sup, "--config", os.path.join(SRC, "configs", "bev_tiny.yaml"), f"experiment.output_dir={d}",
           f"experiment.name={name}", "data.synthetic=true", "train.steps=100000", "train.log_every=1",
           "train.eval_every=0", "checkpoint.every=5", "checkpoint.keep_last=1", "parallel.backend=gloo"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "RANK", "MASTER_"))}
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=d,
                         start_new_session=True)
    run_dir = os.path.join(d, name)
    try:
        # Kill rank 1 two steps after a checkpoint (step 12: checkpoint 10 is committed).
        deadline = time.time() + 300
        while time.time() < deadline:
            r = rows(run_dir)
            if r and r[-1]["step"] >= 12:
                break
            time.sleep(0.01)
        before = rows(run_dir)[-1]["step"]
        ckpt = before - before % 5
        pids = {}
        for pid in children(p.pid):
            env = env_of(pid)
            try:
                exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
            except OSError:
                continue
            if exe == "parallax" and "RANK" in env:
                pids[int(env["RANK"])] = pid
        metrics = os.path.join(run_dir, "metrics.jsonl")
        inode = os.stat(metrics).st_ino
        t0 = time.time()
        os.kill(pids[1], signal.SIGKILL)
        # The restart trims metrics.jsonl back to the checkpoint (a new file, renamed over the old
        # one), then appends the new steps.
        while time.time() < t0 + 300:
            try:
                trimmed = os.stat(metrics).st_ino != inode
            except OSError:
                trimmed = False
            r = rows(run_dir) if trimmed else []
            if r and r[-1]["step"] > ckpt:
                t1 = time.time()
                break
            time.sleep(0.005)
        else:
            raise RuntimeError("no step after the restart within 300 s")
        return {"bench": "launch_restart_latency", "launcher": launcher, "rep": rep, "model": "bev_tiny", "workers": 2,
                "backend": "gloo", "monitor_interval_s": interval, "killed_at_step": before,
                "resumed_from": ckpt, "latency_s": round(t1 - t0, 3)}
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("parallax")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--monitor-interval", type=float, default=0.2)
    ap.add_argument("--launcher", choices=["parallax", "torchrun", "both"], default="parallax")
    a = ap.parse_args()
    launchers = ["parallax", "torchrun"] if a.launcher == "both" else [a.launcher]
    with tempfile.TemporaryDirectory() as d:
        for launcher in launchers:
            out = []
            for rep in range(a.reps):
                r = one(os.path.abspath(a.parallax), d, rep, a.monitor_interval, launcher)
                print(json.dumps(r), flush=True)
                out.append(r["latency_s"])
            print(json.dumps({"bench": "launch_restart_latency", "launcher": launcher, "summary": True,
                              "reps": a.reps, "median_s": statistics.median(out), "min_s": min(out),
                              "max_s": max(out)}), flush=True)


if __name__ == "__main__":
    main()
