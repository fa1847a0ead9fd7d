#!/usr/bin/env python3
"""The run-directory lock (issue 17, item 5) through the real `parallax` binary:

- a second job on a run directory in use fails at once, with one error line naming the holder's
  pid and host, while the first finishes with its own metrics only;
- the lock of a SIGKILLed job does not block the next one (the kernel drops a dead process's flock;
  the .lock file it leaves behind does not matter);
- under mpirun, when another job holds the lock, every rank exits with the error (none waits in a
  collective for rank 0);
- a rerun never clobbers a run (issue 58): a fresh start (train.resume empty) in a directory that
  holds checkpoints is refused with one line naming the three ways on, and loses nothing;
  train.resume=auto continues, experiment.overwrite=true starts again; a config error found after
  the directory was made (1 and 2 ranks) leaves no directory behind.

Usage: test_run_dir.py <parallax binary> <mpirun>
"""
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

PARALLAX = MPIRUN = None
SRC = os.environ.get("PARALLAX_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
MLP = os.path.join(SRC, "configs", "mlp_demo.yaml")


def error_lines(stderr):
    return [l for l in stderr.splitlines() if l.startswith("parallax: error:")]


class RunLockTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name
        self.procs = []

    def tearDown(self):
        for p in self.procs:  # only the jobs this test started
            if p.poll() is None:
                p.kill()
                p.wait()
            p.log.close()
        self.tmp.cleanup()

    def job(self, name, *extra):
        return [PARALLAX, "train", "--config", MLP, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                "model.size=tiny", "train.log_every=1", "schedule.warmup_steps=2", *extra]

    def start(self, cmd):
        """Starts a job whose output goes to a file (a pipe nobody reads would stall a long job)."""
        log = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        p.log = log
        self.procs.append(p)
        return p

    @staticmethod
    def finish(proc, timeout):
        """Waits for `proc`; returns its output."""
        proc.wait(timeout=timeout)
        proc.log.seek(0)
        return proc.log.read()

    def wait_for_holder(self, name, proc, timeout=60):
        """Waits until `proc` holds the lock of run `name` (its pid is the lock file's record)."""
        lock = os.path.join(self.d, name, ".lock")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self.fail(f"the job ended before taking the lock: {self.finish(proc, 10)[-2000:]}")
            try:
                with open(lock) as f:
                    if f.read().split()[:1] == [str(proc.pid)]:
                        return lock
            except (FileNotFoundError, IndexError):
                pass
            time.sleep(0.05)
        self.fail(f"{lock} never named pid {proc.pid}")

    def test_second_job_fails_at_once_naming_the_holder_and_the_first_is_unharmed(self):
        # The small mlp takes ~5 s for 150 steps on 2 idle cores, about 3 times the second job's
        # start-up (both slow down alike on busy cores); the assertion below checks it did outlive it.
        steps = 150
        first = self.start(self.job("shared", "model.size=small", f"train.steps={steps}", "experiment.seed=1",
                                    "checkpoint.every=50"))
        self.wait_for_holder("shared", first)
        start = time.monotonic()
        second = subprocess.run(self.job("shared", "train.steps=5", "experiment.seed=2"), capture_output=True,
                                text=True, timeout=120)
        elapsed = time.monotonic() - start
        self.assertIsNone(first.poll(), "the first job ended before the second was refused: the test proves nothing")
        self.assertNotEqual(second.returncode, 0)
        lines = [l for l in second.stderr.splitlines() if l.strip()]
        self.assertEqual(len(error_lines(second.stderr)), 1, second.stderr)
        self.assertIn(f"run directory '{os.path.join(self.d, 'shared')}' is in use by another job: "
                      f"pid {first.pid} on host {socket.gethostname()} (started ", lines[-1])
        self.assertLess(elapsed, 60)  # start-up only: it never waits for the lock
        err = self.finish(first, 600)
        self.assertEqual(first.returncode, 0, err[-3000:])
        with open(os.path.join(self.d, "shared", "metrics.jsonl")) as f:
            rows = [json.loads(l) for l in f if l.strip()]
        self.assertEqual([r["step"] for r in rows if r["kind"] == "train"], list(range(1, steps + 1)))
        self.assertEqual(sum(r["kind"] == "summary" for r in rows), 1)
        with open(os.path.join(self.d, "shared", "config.yaml")) as f:
            self.assertIn("seed: 1\n", f.read())

    def test_a_sigkilled_jobs_lock_does_not_block_the_next(self):
        killed = self.start(self.job("k", "train.steps=1000000"))
        lock = self.wait_for_holder("k", killed)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
        with open(lock) as f:
            self.assertEqual(f.read().split()[0], str(killed.pid))  # the record stays; the flock is gone
        start = time.monotonic()
        nxt = self.start(self.job("k", "train.steps=3"))
        err = self.finish(nxt, 300)
        self.assertEqual(nxt.returncode, 0, err[-3000:])
        with open(lock) as f:
            self.assertEqual(f.read().split()[0], str(nxt.pid))
        self.assertLess(time.monotonic() - start, 120)

    def test_every_rank_exits_with_the_error_when_another_job_holds_the_lock(self):
        run_dir = os.path.join(self.d, "held")
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, ".lock"), "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what another job on another host holds
            held.write(f"{os.getpid()} other-host 2020-01-01T00:00:00Z\n")
            held.flush()
            cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", "2",
                   *self.job("held", "train.steps=3", "parallel.timeout_s=120", "parallel.init_timeout_s=120")]
            start = time.monotonic()
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            elapsed = time.monotonic() - start
        self.assertNotEqual(p.returncode, 0)
        errors = error_lines(p.stderr)
        self.assertEqual(len(errors), 2, p.stderr[-3000:])  # one per rank, the same line
        for line in errors:
            self.assertIn(f"is in use by another job: pid {os.getpid()} on host other-host "
                          "(started 2020-01-01T00:00:00Z)", line)
        # No rank waited for a collective's deadline (timeout_s = 120 s).
        self.assertLess(elapsed, 60)
        self.assertFalse(os.path.exists(os.path.join(run_dir, "config.yaml")))
        self.assertFalse(os.path.exists(os.path.join(run_dir, "metrics.jsonl")))


class RerunTest(unittest.TestCase):
    """A rerun never clobbers a run; a late config error leaves no run directory (issue 58)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def train(self, name, *extra, np=1):
        cmd = [PARALLAX, "train", "--config", MLP, f"experiment.output_dir={self.d}", f"experiment.name={name}",
               "model.size=tiny", "train.log_every=1", "train.threads=1", *extra]
        if np > 1:
            cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", str(np), *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    def rows(self, name):
        with open(os.path.join(self.d, name, "metrics.jsonl")) as f:
            return [json.loads(l) for l in f if l.strip()]

    def test_a_fresh_start_over_a_runs_checkpoints_is_refused_and_loses_nothing(self):
        run = os.path.join(self.d, "r")
        first = self.train("r", "train.steps=2")
        self.assertEqual(first.returncode, 0, first.stderr[-3000:])
        with open(os.path.join(run, "checkpoints", "latest")) as f:
            latest = f.read()
        before = self.rows("r")
        again = self.train("r", "train.steps=4", "experiment.seed=7")
        self.assertEqual(again.returncode, 3, again.stderr[-3000:])  # deterministic: launch never restarts it
        errors = error_lines(again.stderr)
        self.assertEqual(len(errors), 1, again.stderr)
        for way in ("holds checkpoints of an earlier run", "train.resume=auto", "experiment.name=",
                    "experiment.overwrite=true"):
            self.assertIn(way, errors[0])
        with open(os.path.join(run, "checkpoints", "latest")) as f:
            self.assertEqual(f.read(), latest)
        self.assertEqual(self.rows("r"), before)
        with open(os.path.join(run, "config.yaml")) as f:
            self.assertNotIn("seed: 7\n", f.read())
        # The ways on: continue it ...
        cont = self.train("r", "train.steps=4", "train.resume=auto")
        self.assertEqual(cont.returncode, 0, cont.stderr[-3000:])
        self.assertEqual([r["step"] for r in self.rows("r") if r["kind"] == "train"], [1, 2, 3, 4])
        # ... or start again in it, deleting the earlier run's checkpoints and metrics.
        over = self.train("r", "train.steps=1", "experiment.overwrite=true")
        self.assertEqual(over.returncode, 0, over.stderr[-3000:])
        self.assertIn("experiment.overwrite=true: deleted", over.stderr)
        self.assertEqual([r["step"] for r in self.rows("r") if r["kind"] == "train"], [1])
        self.assertEqual(sorted(os.listdir(os.path.join(run, "checkpoints"))), ["latest", "step_00000001"])

    def test_a_late_config_error_leaves_no_run_directory(self):
        missing = os.path.join(self.d, "no_such_weights.h5")
        for np in (1, 2):
            with self.subTest(np=np):
                name = f"late{np}"
                p = self.train(name, "train.steps=2", f"train.load_from={missing}", np=np)
                self.assertNotEqual(p.returncode, 0)
                self.assertTrue(error_lines(p.stderr), p.stderr[-3000:])
                self.assertIn("no_such_weights.h5", error_lines(p.stderr)[0])
                self.assertFalse(os.path.exists(os.path.join(self.d, name)), os.listdir(self.d))
        # A directory that existed before the job stays, with what was in it.
        keep = os.path.join(self.d, "kept")
        os.makedirs(keep)
        with open(os.path.join(keep, "notes.txt"), "w") as f:
            f.write("mine\n")
        p = self.train("kept", "train.steps=2", f"train.load_from={missing}")
        self.assertNotEqual(p.returncode, 0)
        self.assertEqual(sorted(os.listdir(keep)), [".lock", "notes.txt"])


if __name__ == "__main__":
    PARALLAX = os.path.abspath(sys.argv.pop(1))
    MPIRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
