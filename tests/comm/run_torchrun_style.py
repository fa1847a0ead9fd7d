#!/usr/bin/env python3
"""Starts N copies of a command the way torchrun does (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without mpirun, and waits for all of them.

Usage: run_torchrun_style.py --nproc N [--timeout S] -- command [args...]
Exit code: 0 when every rank exits 0; otherwise the first non-zero code. Every rank's output is
printed, prefixed with its rank. Ranks still running after the timeout are killed (exit 124)."""
import argparse
import os
import socket
import subprocess
import sys
import threading
import time


def free_port():
    # Ask the OS for a free port for MASTER_PORT (the store itself is c10d's TCPStore).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        ap.error("missing command")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_"))}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(a.nproc),
                LOCAL_WORLD_SIZE=str(a.nproc))
    procs, outputs = [], [[] for _ in range(a.nproc)]
    for r in range(a.nproc):
        env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

    def pump(r):
        for line in procs[r].stdout:
            outputs[r].append(line)

    threads = [threading.Thread(target=pump, args=(r,), daemon=True) for r in range(a.nproc)]
    for t in threads:
        t.start()
    deadline = time.time() + a.timeout
    codes = [None] * a.nproc
    while None in codes and time.time() < deadline:
        for r, p in enumerate(procs):
            if codes[r] is None:
                codes[r] = p.poll()
        time.sleep(0.05)
    for r, p in enumerate(procs):
        if codes[r] is None:
            p.kill()
            p.wait()
            codes[r] = 124
    for t in threads:
        t.join(timeout=5)
    for r in range(a.nproc):
        for line in outputs[r]:
            sys.stdout.write(f"[rank {r}] {line}")
        print(f"[rank {r}] exit code {codes[r]}")
    bad = [c for c in codes if c != 0]
    sys.exit(bad[0] if bad else 0)


if __name__ == "__main__":
    main()
