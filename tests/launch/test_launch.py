#!/usr/bin/env python3
"""`parallax launch` (issue 22): restarts, the global budget, deterministic failures, preemption,
and two nodes on one machine. Real processes, the launcher's real TCPStore, gloo on CPU.

Every run trains the mlp stand-in (tiny) on 2 workers; a reference run of the same config without
failures gives the losses and final weights that a restarted or preempted-and-resumed run must
match exactly (same arithmetic by construction: same world, same backend, bitwise resume).

Usage: test_launch.py <parallax binary> [<mpirun>]
PARALLAX_LAUNCH_TEST_DEVICE=cuda runs the same tests on GPUs (nccl; node r of the two-node test sees
GPU r only, as two hosts would, so that test needs 2 GPUs). PARALLAX_LAUNCH_TEST_NPROC sets the
workers per job (default 2; 1 runs the GPU mode on a single GPU: NCCL at world size 1).
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import h5py

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train"))
import test_train as tt  # noqa: E402  (shared helpers: gpu_count)

PARALLAX = MPIRUN = None
SRC = os.environ.get("PARALLAX_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
MLP = os.path.join(SRC, "configs", "mlp_demo.yaml")
STEPS = 1500       # long enough to kill mid-run on a loaded 2-core machine, short enough to finish
CKPT_EVERY = 50
RDZV_S = 6  # --rdzv-timeout of the two-node store-host tests (rendezvous of two local launchers: < 1 s)

EXIT_DETERMINISTIC, EXIT_EXHAUSTED, EXIT_PREEMPTED = 3, 4, 143
DEVICE = os.environ.get("PARALLAX_LAUNCH_TEST_DEVICE", "cpu")
NPROC = int(os.environ.get("PARALLAX_LAUNCH_TEST_NPROC", "2"))
LAST = NPROC - 1  # the worker the kill test kills


def clean_env():
    """os.environ without what would make a child believe it is a rank of some launch (mpirun's
    OMPI_COMM_WORLD_*, ess/orte settings and PMIx identity, torchrun's RANK and MASTER_*). MPI's
    own settings stay: the GPU image's OMPI_MCA_plm=isolated is what lets a lone process start MPI
    as a singleton (without it, as root, "Unable to start a daemon on the local node")."""
    keep = ("OMPI_MCA_", "PMIX_MCA_", "OMPI_ALLOW_")
    drop = ("OMPI_", "PMIX_", "RANK", "MASTER_")
    launch = ("OMPI_MCA_ess", "OMPI_MCA_orte", "OMPI_MCA_pmix")
    return {k: v for k, v in os.environ.items()
            if not k.startswith(drop) or (k.startswith(keep) and not k.startswith(launch))}


gpu_count = tt.gpu_count
DEVICE_ARGS = (["train.device=cuda", "parallel.backend=nccl"] if DEVICE == "cuda"
               else ["parallel.backend=gloo", "train.threads=1"])


def children(pid):
    out = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
    except OSError:
        return out
    for k in map(int, kids):
        out.append(k)
        out.extend(children(k))
    return out


def env_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


def alive(pid):
    """True while `pid` runs (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def worker_pids(launcher_pid):
    """world rank -> pid of the launcher's workers."""
    out = {}
    for pid in children(launcher_pid):
        env = env_of(pid)
        if "RANK" in env and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            out[int(env["RANK"])] = pid
    return out


def rows(run_dir, kind="train"):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line being written
            if r.get("kind", "train") == kind:
                out.append(r)
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def latest_weights(run_dir):
    """Every tensor of the run's latest checkpoint (one replicated file under DDP), by name."""
    ckpt = os.path.realpath(os.path.join(run_dir, "checkpoints", "latest"))
    if not os.path.isdir(ckpt):  # `latest` may be a file naming the step folder
        with open(os.path.join(run_dir, "checkpoints", "latest")) as f:
            ckpt = os.path.join(run_dir, "checkpoints", f.read().strip())
    out = {}

    def take(name, obj):  # returns None: visititems stops at the first non-None return
        if isinstance(obj, h5py.Dataset):
            assert name not in out, f"{name} saved twice"
            out[name] = obj[()]

    for name in sorted(os.listdir(ckpt)):
        if name.endswith(".h5"):
            with h5py.File(os.path.join(ckpt, name), "r") as f:
                f.visititems(take)
    return ckpt, out


class LaunchTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.d = cls.tmp.name
        # The reference: the same job without failures.
        p = cls.launch_cls("ref", ["--nproc-per-node", str(NPROC), "--standalone"])
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
        cls.ref = {r["step"]: r["loss"] for r in rows(os.path.join(cls.d, "ref"))}
        cls.ref_ckpt, cls.ref_weights = latest_weights(os.path.join(cls.d, "ref"))
        assert sorted(cls.ref) == list(range(1, STEPS + 1)), sorted(cls.ref)[-5:]
        assert any(k.startswith("optim") for k in cls.ref_weights) and len(cls.ref_weights) > 6, sorted(cls.ref_weights)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @classmethod
    def train_args(cls, name, *extra):
        return ["train", "--config", MLP, f"experiment.output_dir={cls.d}", f"experiment.name={name}",
                "model.size=tiny", f"train.steps={STEPS}", "train.log_every=1", "schedule.warmup_steps=2",
                f"checkpoint.every={CKPT_EVERY}", "checkpoint.keep_last=2", "parallel.timeout_s=20", *DEVICE_ARGS,
                *extra]

    @classmethod
    def launch_cls(cls, name, launcher_args, *extra, gpus=None):
        cmd = [PARALLAX, "launch", *launcher_args, "--", "parallax", *cls.train_args(name, *extra)]
        env = clean_env()
        if gpus is not None and DEVICE == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = gpus
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=cls.d, start_new_session=True)

    def launch(self, name, launcher_args, *extra, gpus=None):
        return self.launch_cls(name, launcher_args, *extra, gpus=gpus)

    def wait_rows(self, proc, name, min_step, timeout=120):
        run_dir = os.path.join(self.d, name)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                self.fail(f"launcher ended before step {min_step}: {proc.stderr.read()[-4000:]}")
            r = rows(run_dir)
            if r and r[-1]["step"] >= min_step:
                return r[-1]["step"]
            time.sleep(0.05)
        self.fail(f"step {min_step} not reached within {timeout} s")

    def finish(self, proc, timeout=300):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            self.fail(f"launcher did not end within {timeout} s:\n{err[-4000:]}")
        return proc.returncode, err

    def check_exactly_once_and_equal(self, name):
        run_dir = os.path.join(self.d, name)
        got = rows(run_dir)
        steps = [r["step"] for r in got]
        self.assertEqual(steps, list(range(1, STEPS + 1)), "each metrics row exactly once")
        for r in got:
            self.assertEqual(r["loss"], self.ref[r["step"]], f"loss differs at step {r['step']}")
        _, w = latest_weights(run_dir)
        self.assertEqual(sorted(w), sorted(self.ref_weights))
        for k in w:
            self.assertEqual(w[k].tobytes(), self.ref_weights[k].tobytes(), f"tensor {k} differs")

    def test_sigkill_of_a_worker_restarts_the_group_and_matches_an_uninterrupted_run(self):
        p = self.launch("kill", ["--nproc-per-node", str(NPROC), "--standalone", "--max-restarts", "2",
                                 "--grace-period", "5"])
        self.wait_rows(p, "kill", CKPT_EVERY + 10)
        pids = worker_pids(p.pid)
        self.assertEqual(sorted(pids), list(range(NPROC)))
        os.kill(pids[LAST], signal.SIGKILL)
        rc, err = self.finish(p)
        self.assertEqual(rc, 0, err[-4000:])
        self.assertRegex(err, rf"worker failed: node 0 rank {LAST} \(local rank {LAST}, pid \d+\) died on signal 9 "
                              r"\(SIGKILL\)")
        self.assertIn("restarting all 1 node(s): restart 1 of 2", err)
        self.assertIn("resuming from", err)  # rank 0's output on the console
        self.check_exactly_once_and_equal("kill")
        with open(os.path.join(self.d, "kill", "logs", f"rank_{LAST}.log")) as f:
            log = f.read()
        self.assertIn(f"attempt 0, rank {LAST}", log)
        self.assertIn(f"attempt 1, rank {LAST}", log)

    def test_restart_budget_exhausted_exits_4_naming_it(self):
        p = self.launch("nan", ["--nproc-per-node", str(NPROC), "--standalone", "--max-restarts", "1"],
                        "train.steps=5", "optim.lr=1e30", "optim.grad_clip=0")
        rc, err = self.finish(p)
        self.assertEqual(rc, EXIT_EXHAUSTED, err[-4000:])
        self.assertRegex(err, r"parallax: error: launch: restart budget exhausted: node 0 rank \d .*exited with "
                              r"code 1 after 1 restart\(s\) \(--max-restarts 1\)")
        self.assertEqual(err.count("restarting all"), 1)

    def test_config_error_in_a_worker_is_not_restarted(self):
        # dp=3 on 1 or 2 workers: a LayoutError inside the workers (the launcher's config load passes).
        p = self.launch("layout", ["--nproc-per-node", str(NPROC), "--standalone", "--max-restarts", "3"],
                        "parallel.dp=3")
        rc, err = self.finish(p)
        self.assertEqual(rc, EXIT_DETERMINISTIC, err[-4000:])
        self.assertIn("a deterministic failure", err)
        self.assertNotIn("restarting", err)
        with open(os.path.join(self.d, "layout", "logs", "rank_0.log")) as f:
            log = f.read()
        self.assertNotIn("attempt 1", log)
        # A config error the launcher sees itself: nothing is started.
        p = self.launch("badkey", ["--nproc-per-node", str(NPROC), "--standalone"], "train.no_such_key=1")
        rc, err = self.finish(p)
        self.assertEqual(rc, EXIT_DETERMINISTIC, err[-4000:])
        self.assertRegex(err, r"parallax: error: .*no_such_key")

    def test_sigterm_to_the_launcher_checkpoints_and_the_resumed_run_continues_bitwise(self):
        p = self.launch("pre", ["--nproc-per-node", str(NPROC), "--standalone"])
        self.wait_rows(p, "pre", 30)
        os.kill(p.pid, signal.SIGTERM)
        rc, err = self.finish(p)
        self.assertEqual(rc, EXIT_PREEMPTED, err[-4000:])
        run_dir = os.path.join(self.d, "pre")
        ckpt, _ = latest_weights(run_dir)
        last = rows(run_dir)[-1]["step"]
        self.assertLess(last, STEPS)
        self.assertTrue(ckpt.endswith(f"step_{last:08d}"), (ckpt, last))
        self.assertIn("preempted", err)
        # Resumed (train.resume=auto is added by the launcher): continues bitwise.
        p = self.launch("pre", ["--nproc-per-node", str(NPROC), "--standalone"])
        rc, err = self.finish(p)
        self.assertEqual(rc, 0, err[-4000:])
        self.check_exactly_once_and_equal("pre")

    def test_sigint_to_a_lone_train_process_checkpoints_and_exits_143(self):
        """Ctrl-C without any launcher: one process, the vote without peers."""
        cmd = [PARALLAX, *self.train_args("alone", "parallel.backend=auto")]
        env = clean_env()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=self.d,
                             start_new_session=True)
        self.wait_rows(p, "alone", 20)
        os.kill(p.pid, signal.SIGINT)
        rc, err = self.finish(p, timeout=60)
        self.assertEqual(rc, EXIT_PREEMPTED, err[-4000:])
        self.assertIn("SIGINT received: stopping after the current step", err)
        run_dir = os.path.join(self.d, "alone")
        ckpt, w = latest_weights(run_dir)
        last = rows(run_dir)[-1]["step"]
        self.assertTrue(ckpt.endswith(f"step_{last:08d}"), (ckpt, last))
        self.assertTrue(w)

    def test_a_killed_launcher_takes_its_workers_with_it(self):
        p = self.launch("orphans", ["--nproc-per-node", str(NPROC), "--standalone"])
        self.wait_rows(p, "orphans", 5)
        pids = worker_pids(p.pid)
        self.assertEqual(sorted(pids), list(range(NPROC)))
        os.kill(p.pid, signal.SIGKILL)
        p.communicate()
        deadline = time.time() + 10
        while time.time() < deadline and any(map(alive, pids.values())):
            time.sleep(0.05)
        left = [q for q in pids.values() if alive(q)]
        for q in left:
            os.kill(q, signal.SIGKILL)
        self.assertEqual(left, [], "workers outlived their launcher")

    @unittest.skipIf(DEVICE == "cuda", "the CPU reference run is gloo")
    def test_sigterm_to_one_rank_under_mpirun_stops_every_rank_after_the_same_step(self):
        """No launcher: only rank 1 gets SIGTERM; the per-step vote stops both after one step, both
        save (one collective checkpoint), exit 143, and the resumed run continues bitwise."""
        if not MPIRUN:
            self.skipTest("no mpirun given")
        cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", "2", PARALLAX,
               *self.train_args("mpi", "train.resume=auto")]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMIX_RANK"))}
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=self.d,
                             start_new_session=True)
        self.wait_rows(p, "mpi", 30)
        ranks = {int(env_of(pid)["OMPI_COMM_WORLD_RANK"]): pid for pid in children(p.pid)
                 if "OMPI_COMM_WORLD_RANK" in env_of(pid) and os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "parallax"}
        self.assertEqual(sorted(ranks), [0, 1])
        os.kill(ranks[1], signal.SIGTERM)
        rc, err = self.finish(p, timeout=120)
        self.assertEqual(rc, EXIT_PREEMPTED, err[-4000:])
        run_dir = os.path.join(self.d, "mpi")
        ckpt, _ = latest_weights(run_dir)
        last = rows(run_dir)[-1]["step"]
        self.assertLess(last, STEPS)
        self.assertTrue(ckpt.endswith(f"step_{last:08d}"), (ckpt, last))
        self.assertIn("SIGTERM received: stopping after the current step", err)
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=self.d)
        rc, err = self.finish(p)
        self.assertEqual(rc, 0, err[-4000:])
        self.check_exactly_once_and_equal("mpi")

    def test_nproc_per_node_is_capped_at_the_node_unless_forced(self):
        """Issue 35 item 4: --nproc-per-node 100000 started 347 workers (22.5 GB) before failing. The
        launcher now refuses more workers than the node's GPUs (CPU workers: cores) in one line
        naming the flag and the count, before anything starts; --allow-oversubscribe starts them."""
        limit = gpu_count() if DEVICE == "cuda" else len(os.sched_getaffinity(0))
        what = "GPU(s)" if DEVICE == "cuda" else "CPU core(s)"
        for n in (limit + 1, 100000):
            start = time.time()
            p = self.launch(f"over{n}", ["--nproc-per-node", str(n), "--standalone"])
            rc, err = self.finish(p, timeout=60)
            self.assertLess(time.time() - start, 10)
            self.assertEqual(rc, 2, err[-2000:])  # a usage error
            errors = [line for line in err.splitlines() if line.strip()]
            self.assertEqual(len(errors), 1, err[-2000:])
            self.assertTrue(errors[0].startswith(f"parallax: error: launch: --nproc-per-node {n} is more than "),
                            errors[0])
            self.assertIn(f"{limit} {what}" if n == limit + 1 else "1024 workers per node", errors[0])
            self.assertFalse(os.path.exists(os.path.join(self.d, f"over{n}")), "nothing started")
        if DEVICE == "cuda":
            return  # workers sharing a GPU cannot form an NCCL group: the forced run is CPU only
        # Forced: limit + 1 CPU workers train together.
        n = limit + 1
        cmd = [PARALLAX, "launch", "--nproc-per-node", str(n), "--standalone", "--allow-oversubscribe", "--",
               "train", "--config", MLP, f"experiment.output_dir={self.d}", "experiment.name=forced",
               "model.size=tiny", "train.steps=2", "train.log_every=1", *DEVICE_ARGS]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(),
                             cwd=self.d, start_new_session=True)
        rc, err = self.finish(p, timeout=240)
        self.assertEqual(rc, 0, err[-3000:])
        self.assertIn(f"{n} worker(s) of {n}", err)
        self.assertEqual([r["step"] for r in rows(os.path.join(self.d, "forced"))], [1, 2])

    def test_two_nodes_on_one_machine_restart_together(self):
        if NPROC != 2:
            self.skipTest("two nodes of one worker each match the reference of 2 workers only")
        if DEVICE == "cuda" and gpu_count() < 2:
            self.skipTest("each node takes its own GPU: needs 2")
        port = free_port()
        common = ["--nproc-per-node", "1", "--nnodes", "2", "--master", f"127.0.0.1:{port}", "--max-restarts", "1",
                  "--grace-period", "5"]
        n0 = self.launch("nodes", [*common, "--node-rank", "0"], gpus="0")
        n1 = self.launch("nodes", [*common, "--node-rank", "1"], gpus="1")
        try:
            self.wait_rows(n0, "nodes", CKPT_EVERY + 10)
            pids = worker_pids(n1.pid)
            self.assertEqual(sorted(pids), [1])
            os.kill(pids[1], signal.SIGKILL)
            rc1, err1 = self.finish(n1)
            rc0, err0 = self.finish(n0)
        finally:
            for p in (n0, n1):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        self.assertEqual((rc0, rc1), (0, 0), err0[-3000:] + err1[-3000:])
        self.assertRegex(err1, r"worker failed: node 1 rank 1 .*died on signal 9")
        self.assertIn("restarting all 2 node(s): restart 1 of 1", err0)
        self.assertIn("restarting all 2 node(s): restart 1 of 1", err1)
        self.check_exactly_once_and_equal("nodes")

    def store_host_fails(self, name, sig, grace_s, extra=()):
        """Two nodes of one rank each, --rdzv-timeout RDZV_S; once node 0 (the store host) has trained 5
        rows its launcher gets `sig`. Returns node 1's (returncode, stderr, seconds to its end)."""
        if DEVICE == "cuda" and gpu_count() < 2:
            self.skipTest("each node takes its own GPU: needs 2")
        port = free_port()
        common = ["--nproc-per-node", "1", "--nnodes", "2", "--master", f"127.0.0.1:{port}", "--rdzv-timeout",
                  str(RDZV_S), "--grace-period", str(grace_s)]
        n0 = self.launch(name, [*common, "--node-rank", "0"], *extra, gpus="0")
        n1 = self.launch(name, [*common, "--node-rank", "1"], *extra, gpus="1")
        try:
            self.wait_rows(n0, name, 5)
            os.kill(n0.pid, sig)
            start = time.time()
            rc1, err1 = self.finish(n1, timeout=120)
            took = time.time() - start
        finally:
            for p in (n0, n1):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.communicate()
                for f in (p.stdout, p.stderr):
                    if f:
                        f.close()
        return rc1, err1, took

    def test_a_stopped_store_host_ends_the_other_node_within_the_rdzv_timeout(self):
        """Node 0's launcher (the store host) is stopped, not dead: c10d's client calls have no
        deadline, so node 1's launcher bounds each store call by --rdzv-timeout and ends its job with
        one error naming the store."""
        rc1, err1, took = self.store_host_fails("stopped", signal.SIGSTOP, grace_s=2)
        self.assertNotEqual(rc1, 0, err1[-3000:])
        errors = [line for line in err1.splitlines() if line.startswith("parallax: error:")]
        self.assertEqual(len(errors), 1, err1[-3000:])
        self.assertIn("store at 127.0.0.1", errors[0])
        self.assertIn(f"did not answer within {RDZV_S} s (--rdzv-timeout)", errors[0])
        # The deadline, the workers' grace period, and slack for a loaded 2-core machine.
        self.assertLess(took, RDZV_S + 2 + 20)

    def test_a_killed_store_host_ends_the_other_node_with_one_line_messages(self):
        """Issue 35, item 6: node 0's launcher (the store host) is killed while the workers checkpoint
        every step. Node 1's launcher and its worker report the store's failure in one line each:
        no c10 backtrace ("Exception raised from ... at /__w/pytorch/...", "frame #..." lines)."""
        rc1, err1, took = self.store_host_fails("killed", signal.SIGKILL, grace_s=5, extra=("checkpoint.every=1",))
        print("\n  " + "\n  ".join(l for l in err1.splitlines() if "error" in l.lower()), file=sys.stderr)
        self.assertNotEqual(rc1, 0, err1[-3000:])
        self.assertNotIn("Exception raised from", err1)
        self.assertNotRegex(err1, r"frame #\d+")
        errors = [line for line in err1.splitlines() if line.startswith("parallax: error:")]
        self.assertTrue(errors, err1[-3000:])
        self.assertLess(took, RDZV_S + 5 + 30)


if __name__ == "__main__":
    PARALLAX = os.path.abspath(sys.argv.pop(1))
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        MPIRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
