#!/usr/bin/env python3
"""A rank stopped (SIGSTOP) during start-up never hangs the job (issue 58, item 1).

2 CPU ranks start the mlp stand-in with parallel.timeout_s=T under mpirun, torchrun and
`parallax launch`; one rank is stopped a few moments after it appears, usually before or inside
MPI_Init_thread (which has no deadline of its own), the store connection or the communicator's
creation. Whatever phase the stop lands in, the surviving rank prints exactly one
`parallax: error:` line within T + slack, naming the phase (or the op) and the stopped rank.
Before the start-up deadline, a stop in MPI_Init held the other rank forever, with no line.

Usage: test_startup.py <parallax binary> <mpirun>
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_stopped_rank as stopped  # noqa: E402  (children, rank_pids, end_job, alive)

PARALLAX = MPIRUN = None
SRC = os.environ.get("PARALLAX_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
MLP = os.path.join(SRC, "configs", "mlp_demo.yaml")
T = 5        # parallel.timeout_s: the start-up deadline is the smaller of it and init_timeout_s
SLACK = 25   # beyond T: process start-up on a loaded 2-core machine, the launcher's teardown


class StartupStopTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def command(self, launcher, name):
        args = ["train", "--config", MLP, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                "model.size=tiny", "train.steps=1000000", "train.log_every=1000", f"parallel.timeout_s={T}",
                f"parallel.backend={'mpi' if launcher == 'mpirun' else 'gloo'}", "train.threads=1"]
        if launcher == "mpirun":
            return [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", "2", PARALLAX, *args]
        if launcher == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--no-python",
                    "--monitor-interval", "0.2", PARALLAX, *args]
        return [PARALLAX, "launch", "--nproc-per-node", "2", "--standalone", "--grace-period", "1",
                "--allow-oversubscribe", "--log-dir", os.path.join(self.d, name + "_logs"), "--", *args]

    def run_case(self, launcher, victim, delay):
        """Starts the job, stops `victim` `delay` s after it appears, returns (elapsed, survivor's
        error lines, all stderr) once the survivor is gone (or fails the test after T + SLACK)."""
        name = f"{launcher}_{victim}_{int(delay * 10)}"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OMPI_COMM_WORLD", "PMIX_RANK", "TORCHELASTIC", "PARALLAX_STARTUP"))}
        err_path = os.path.join(self.d, name + ".stderr")
        with open(err_path, "w") as err:
            proc = subprocess.Popen(self.command(launcher, name), stdout=subprocess.DEVNULL, stderr=err,
                                    cwd=self.d, env=env, start_new_session=True)
        pids = {}
        try:
            deadline = time.time() + 60
            while victim not in pids or len(pids) < 2:
                self.assertLess(time.time(), deadline, f"{name}: the ranks did not appear")
                self.assertIsNone(proc.poll(), f"{name}: the job ended before the stop")
                pids = stopped.rank_pids(proc.pid)
                time.sleep(0.02)
            time.sleep(delay)
            os.kill(pids[victim], signal.SIGSTOP)
            start = time.time()
            survivor = pids[1 - victim]
            # The survivor ends (mpirun then tears the job down; torchrun and the launcher wait for
            # their own SIGTERM grace on the stopped worker, which is theirs, not this test's).
            while stopped.alive(survivor) and time.time() < start + T + SLACK:
                time.sleep(0.1)
            elapsed = time.time() - start
            survived = stopped.alive(survivor)
        finally:
            stopped.end_job(proc, pids)
        with open(err_path, errors="replace") as f:
            err = f.read()
        if launcher == "launch":  # the workers' lines are in their own logs (the console echoes some)
            logs = os.path.join(self.d, name + "_logs")
            err = ""
            for log in sorted(os.listdir(logs)):
                with open(os.path.join(logs, log), errors="replace") as f:
                    err += f.read()
        if survived:
            self.fail(f"{name}: rank {1 - victim} still waits {T + SLACK} s after rank {victim} was stopped "
                      f"{delay} s into start-up:\n{err[-3000:]}")
        lines = [l for l in err.splitlines() if l.startswith("parallax: error:")]
        mine = [l for l in lines if re.search(rf"\brank {1 - victim}\b", l)]
        return name, elapsed, mine, err

    def check(self, launcher, victim, delay):
        name, elapsed, mine, err = self.run_case(launcher, victim, delay)
        self.assertNotIn("frame #", err)
        self.assertEqual(len(mine), 1, f"{name}: expected one error line from rank {1 - victim}:\n{err[-4000:]}")
        line = mine[0]
        # The phase or op, and the stopped rank: by the start-up report (this host's ranks), as the
        # rank that never arrived, whose heartbeat stopped, or as the store's host.
        self.assertRegex(line, r"start-up did not finish|timed out|within the init timeout|cannot reach", line)
        self.assertRegex(line, rf"rank {victim} \(pid \d+\) is stopped|never arrived: \[{victim}\]|"
                               rf"Not responding .*world rank {victim}\b|its host, world rank {victim}\b|"
                               rf"from rank {victim}\b", line)
        self.assertLess(elapsed, T + SLACK)
        print(f"\n  {name}: rank {1 - victim} ended {elapsed:.1f} s after the stop: {line[:300]}", file=sys.stderr)

    def check_all(self, cases):
        """Runs the cases two at a time (each mostly waits), reporting every failure."""
        failures = []

        def one(case):
            try:
                self.check(*case)
            except AssertionError as e:  # collected: unittest's own state is not thread-safe
                failures.append(f"{case}: {e}")

        for i in range(0, len(cases), 2):
            threads = [threading.Thread(target=one, args=(c,)) for c in cases[i:i + 2]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        self.assertEqual(failures, [], "\n\n".join(failures))

    def test_mpirun_stop_during_startup(self):
        """Rank 0 and rank 1, stopped early (usually before MPI_Init_thread) and later (inside it,
        or in the store's or the communicator's rendezvous)."""
        self.check_all([("mpirun", 0, 0.3), ("mpirun", 1, 0.3), ("mpirun", 0, 0.9), ("mpirun", 1, 0.9)])

    def test_torchrun_and_launch_stop_during_startup(self):
        self.check_all([("torchrun", 0, 0.5), ("launch", 0, 0.5), ("launch", 1, 1.5)])


if __name__ == "__main__":
    PARALLAX, MPIRUN = os.path.abspath(sys.argv[1]), sys.argv[2]
    stopped.PARALLAX, stopped.MPIRUN = PARALLAX, MPIRUN
    unittest.main(argv=sys.argv[:1] + sys.argv[3:], verbosity=2)
