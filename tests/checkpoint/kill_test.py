#!/usr/bin/env python3
"""Crash consistency: SIGKILL a process that saves checkpoints in a loop, at random moments, many
times; after every kill `latest` must load, verify its checksums and hold exactly the state of its
step (ckpt_tool verify, on a byte-for-byte copy of the folder as the kill left it, which runs while
the next saver starts), and it must be the last committed step or the one being committed. The
next save must clean the leftovers of killed saves.

usage: kill_test.py CKPT_TOOL MPIRUN [--iterations N] [--mpi-iterations M]
"""
import argparse
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time


def start(cmd):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines = []

    def pump():
        for line in proc.stdout:
            lines.append(line.strip())

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    return proc, lines, t


def session_members(sid, live=False):
    """Pids of the processes of session `sid` (mpirun and its ranks: each rank has its own process
    group, but they share mpirun's session); with `live`, not the zombies (dead, their files closed,
    only waiting for init to reap them, which can take seconds)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[3]) == sid and not (live and fields[0] in ("Z", "X")):  # fields 3 and 6: state, session
            pids.append(int(entry))
    return pids


def kill_all(proc, rng):
    """SIGKILL every process of the saver's session, the ranks in random order, then mpirun."""
    members = [p for p in session_members(proc.pid) if p != proc.pid]
    rng.shuffle(members)
    for pid in members + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def committed(lines):
    steps = [int(l.split()[1]) for l in lines if l.startswith("committed ")]
    return steps[-1] if steps else 0


class Verify:
    """`ckpt_tool verify` of the checkpoint folder as a kill left it, done on a byte-for-byte copy
    so that it runs while the next saver starts (both mostly wait on disk and on loading LibTorch):
    `latest` must load, verify its checksums and hold exactly the state of its step."""

    def __init__(self, tool, ckpt_dir, seed, copy):
        shutil.copytree(ckpt_dir, copy, symlinks=True)
        self.copy = copy
        self.proc = None
        if os.path.exists(os.path.join(copy, "latest")):
            self.proc = subprocess.Popen([tool, "verify", copy, str(seed)], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)

    def step(self):
        """The step `latest` holds (0: no `latest` yet); exits the test if it does not verify."""
        if self.proc is None:
            return 0
        out, err = self.proc.communicate()
        shutil.rmtree(self.copy)
        if self.proc.returncode != 0:
            raise SystemExit(f"latest does not verify: {out}{err}")
        return int(out.split()[-1])


class Kill:
    """What one kill left: checked by check(), once its verify has run."""

    def __init__(self, verify, last_seen, lag, leftovers, label):
        self.verify, self.last_seen, self.lag, self.leftovers, self.label = verify, last_seen, lag, leftovers, label

    def check(self):
        step = self.verify.step()
        # `latest` is the last commit the saver reported, or the next one if the kill came between
        # the rename of `latest` and the print (under mpirun, rank 0's prints reach us through
        # mpirun's forwarding and may lag by a few commits).
        if not (self.last_seen <= step <= self.last_seen + self.lag):
            raise SystemExit(f"{self.label}: latest is step {step}, but the saver last reported {self.last_seen}")
        print(f"{self.label}: killed after commit {self.last_seen}; latest verifies at step {step}; "
              f"leftovers {len(self.leftovers)}")
        return bool(self.leftovers)


def run_once(tool, cmd_prefix, ckpt_dir, seed, kib, rng, label, previous, copy):
    """Starts a saver on `ckpt_dir`, checks the `previous` kill (its verify ran meanwhile), kills the
    saver at a random moment among its saves; returns this kill, its verify started on `copy`."""
    proc, lines, pump = start(cmd_prefix + [tool, "kill-loop", ckpt_dir, str(seed), str(kib)])
    try:
        saw_leftovers = previous.check() if previous else False
    except BaseException:
        kill_all(proc, rng)  # a saver left running would save forever
        proc.wait()
        raise
    deadline = time.time() + 60
    # Wait for at least one commit of this run, so that the kill lands among saves.
    while committed(lines) == 0 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    if proc.poll() is not None:
        raise SystemExit(f"{label}: the saver exited early ({proc.returncode}): {proc.stderr.read()}")
    # A save takes 20-40 ms (one process and 2 ranks alike): a kill at a uniform time over several
    # saves lands at a uniform point of the save's phases (shard writes, commit, `latest`, pruning).
    time.sleep(rng.uniform(0.0, 0.15))
    last_seen = committed(lines)
    kill_all(proc, rng)
    proc.wait()
    deadline = time.time() + 10
    while session_members(proc.pid, live=True) and time.time() < deadline:  # every rank dead
        time.sleep(0.01)
    pump.join(timeout=5)
    last_seen = max(last_seen, committed(lines))
    leftovers = [n for n in os.listdir(ckpt_dir) if n.startswith(".tmp-") or n.startswith("latest.tmp-")]
    lag = 1 if not cmd_prefix else 5
    return Kill(Verify(tool, ckpt_dir, seed, copy), last_seen, lag, leftovers, label), saw_leftovers


def committed_step(tool, ckpt_dir, seed):
    if not os.path.exists(os.path.join(ckpt_dir, "latest")):
        return 0
    out = subprocess.run([tool, "verify", ckpt_dir, str(seed)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"latest does not verify: {out.stdout}{out.stderr}")
    return int(out.stdout.split()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tool")
    ap.add_argument("mpirun")
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--mpi-iterations", type=int, default=6)
    args = ap.parse_args()
    seed = random.SystemRandom().randrange(1, 1 << 40)
    rng = random.Random(seed)
    print(f"seed {seed}")
    mpi = [args.mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2"]
    with tempfile.TemporaryDirectory(prefix="parallax_kill_") as tmp:
        ckpt_dir = os.path.join(tmp, "checkpoints")
        saw_leftovers = 0
        runs = [("single", [], 256)] * args.iterations + [("mpi-2", mpi, 128)] * args.mpi_iterations
        kill = None
        for i, (label, prefix, kib) in enumerate(runs):
            kill, left = run_once(args.tool, prefix, ckpt_dir, seed, kib, rng, f"{label} #{i}", kill,
                                  os.path.join(tmp, f"verified_{i}"))
            saw_leftovers += left
        saw_leftovers += kill.check()
        # The next save removes every leftover of killed saves and commits.
        out = subprocess.run([args.tool, "save-once", ckpt_dir, str(seed), "99999"], capture_output=True,
                             text=True)
        if out.returncode != 0:
            raise SystemExit(f"save after the kills failed: {out.stderr}")
        left = [n for n in os.listdir(ckpt_dir) if n.startswith(".tmp-") or n.startswith("latest.tmp-")]
        if left:
            raise SystemExit(f"leftovers not cleaned by the next save: {left}")
        if committed_step(args.tool, ckpt_dir, seed) != 99999:
            raise SystemExit("the save after the kills is not latest")
        steps = sorted(n for n in os.listdir(ckpt_dir) if n.startswith("step_"))
        if len(steps) > 2:
            raise SystemExit(f"keep_last=2 not honoured: {steps}")
        print(f"{len(runs)} kills, {saw_leftovers} left a partial save behind; latest always verified")
    print(f"{len(runs)} passed, 0 failed")


if __name__ == "__main__":
    main()
