#!/usr/bin/env python3
"""End-to-end training through the real `parallax` binary (and mpirun for 2 ranks):

- exact resume: a CPU fp32 run that resumes from its step-4 checkpoint ends bitwise identical
  (weights and per-step losses) to the uninterrupted run, on 1 rank and on 2 ranks (DDP);
- a checkpoint saved by 2 ranks resumes on 1 rank (resharding of replicated state);
- the BEV model trains on a generated dataset with 2 ranks, evaluates (nuScenes-style metrics in
  metrics.jsonl), checkpoints, and `parallax inspect` verifies the checkpoint;
- activation checkpointing and bf16 autocast run end to end;
- a NaN loss stops training with a clear error that names the step.

Usage: test_train.py <parallax binary> <mpirun>
"""
import concurrent.futures
import json
import re
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import zlib

import h5py
import numpy as np

PARALLAX = MPIRUN = None
SRC = os.environ.get("PARALLAX_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
MLP = os.path.join(SRC, "configs", "mlp_demo.yaml")
BEV = os.path.join(SRC, "configs", "bev_tiny.yaml")


def run(args, ranks=1, timeout=600, check=True):
    cmd = [PARALLAX, *args]
    if ranks > 1:
        cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", str(ranks), *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return p


def metrics(run_dir, kind="train"):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r["kind"] == kind]


def losses(run_dir):
    """Per-step training losses of a run: {step: loss}."""
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


def gpu_count():
    """GPUs `nvidia-smi -L` lists (0 without a GPU or without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def fp8_gpu():
    """Whether GPU 0 has FP8 tensor cores (compute capability >= 8.9)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return False
    return bool(out) and float(out[0]) >= 8.9


def rewrite_tensor(path, name, change):
    """Replaces tensor `name` of weights file `path` by change(its array), as an h5py user editing a
    weights.h5 does: with its new crc32 attribute (every load verifies it; docs/checkpoints.md)."""
    with h5py.File(path, "r+") as f:
        a = change(f[name][()])
        f[name][...] = a
        f[name].attrs["crc32"] = zlib.crc32(np.ascontiguousarray(a).tobytes())


def flip_byte(path, dataset):
    """Flips one byte in the middle of `dataset`'s data inside HDF5 file `path` (the file keeps its
    size and its structure: only a checksum can tell)."""
    with h5py.File(path, "r") as f:
        at = f[dataset].id.get_offset() + f[dataset].id.get_storage_size() // 2
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x5A]))


def read_weights(path):
    """Every tensor of a weights.h5: {name: array}."""
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
        return out


def weights(run_dir):
    run(["export", "--run", run_dir, "--format", "weights"])
    return read_weights(os.path.join(run_dir, "export", "weights.h5"))


def exported_weights(out, *source):
    """The weights of `source` (["--run", dir] or ["--checkpoint", step dir]), exported to `out`
    (a run shared by several tests stays as it is)."""
    run(["export", *source, "--format", "weights", "--out", out])
    return read_weights(out)


def side_by_side(*calls, workers=2):
    """Runs the independent calls (functions of no argument) `workers` at a time; their futures, in
    order (`.result()` returns the call's value or raises its exception)."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(c) for c in calls]
    return futures


class SkippedPlots:
    """For test files that read no plot: PARALLAX_PYTHON, the interpreter the trainer runs
    tools/plot_metrics.py with (~1 s of CPU per run), becomes a script that skips that tool and runs
    anything else (the ONNX parity check) with the interpreter given before. start() in
    setUpModule, stop() in tearDownModule."""

    def __init__(self):
        self.saved = self.tmp = None

    def start(self):
        self.saved = os.environ.get("PARALLAX_PYTHON")
        self.tmp = tempfile.TemporaryDirectory()
        script = os.path.join(self.tmp.name, "python_without_plots")
        with open(script, "w") as f:
            f.write("#!/bin/sh\n"
                    'case "$1" in */plot_metrics.py) exit 0 ;; esac\n'
                    f"exec '{self.saved or sys.executable}' \"$@\"\n")
        os.chmod(script, 0o755)
        os.environ["PARALLAX_PYTHON"] = script

    def stop(self):
        if self.saved is None:
            os.environ.pop("PARALLAX_PYTHON", None)
        else:
            os.environ["PARALLAX_PYTHON"] = self.saved
        self.tmp.cleanup()


# ---- Multi-rank equivalence: the first step, then SGD (tests/TOLERANCES.md, "Equivalence tests") ----
#
# A run split over ranks (tp, pp, dp, ZeRO pieces, another layout after a resume) is compared with
# its reference at the FIRST step (loss terms, gradient norm) with derived bounds, and over a few
# steps only under SGD with momentum (SGD below) or for at most 2 AdamW steps. AdamW's update
# m / sqrt(v) is a normalised one (its first step is lr sign(g)): a gradient element within rounding
# of zero moves its weight by +-lr either way, so two AdamW runs that differ by rounding at step 1
# drift apart chaotically (measured on an AMD EPYC, bev tp 2 vs 1 rank: grad norm 2.3e-6 apart at
# step 2, 1.2e-2 at step 9), and no bound from the arithmetic holds after 2-3 steps. An SGD step is
# linear in the gradient: a rounding difference in a gradient stays a difference of that relative
# size in the update (same runs under SGD: within 1.7e-5 over 10 steps).
U = 2.0 ** -24  # fp32 unit roundoff


def gamma(k, u=U):
    """k u / (1 - k u): the relative bound of k accumulated roundings (any summation order)."""
    return k * u / (1 - k * u)


# The model-level rounding bounds of tests/parallel/tensor_parallel_test.cpp (kForward, kGrad): two
# evaluations of the same model that sum the dot products of its layers in another order (tp partial
# sums added by an all-reduce, a dp rank's GEMM on fewer rows with another blocking, a kernel chosen
# for another layout) differ per dot product of K <= 384 terms by at most 2 gamma_384 S, S the sum
# of the terms' magnitudes; 4 GEMMs per block, 2 blocks, 2 orders give the forward's bound relative
# to 1 + |value| (the LayerNorms keep activations O(1)), and the backward runs the GEMMs twice. The
# mlp tiny (3 GEMMs of K <= 65, then a mean of <= 384 squares) is within the same bound.
K_FORWARD = 4 * 2 * 2 * 2.3e-5
K_GRAD = 2 * K_FORWARD
MOMENTUM = 0.9


def sgd(lr):
    """Overrides for SGD with momentum 0.9 (no Nesterov) at peak learning rate `lr`."""
    return ["optim.name=sgd", f"optim.lr={lr}", f"optim.momentum={MOMENTUM}"]


def rows(run_dir):
    """Training rows of a run by step: {step: {"loss": ..., "grad_norm": ..., "loss_<term>": ...}}."""
    return {r["step"]: r for r in metrics(run_dir)}


def loss_terms(row):
    """The loss terms of a metrics row. Not loss_scale (fp16's scaler) and not vit_cls's
    loss_accuracy: a fraction of argmax hits, which a rounding difference at a tie moves by a whole
    sample (not a rounding-bounded value)."""
    return {k: v for k, v in row.items() if k.startswith("loss_") and k not in ("loss_scale", "loss_accuracy")}


def first_step_bounds(want):
    """Bounds on a split run's step-1 values against the reference row `want` (same weights, same
    data, the reductions in other orders): each loss term within K_FORWARD (1 + |term|); the total
    (a sum of the terms with weights <= 1) within the sum of those plus 4 u |loss| for its own
    roundings; the gradient norm within K_GRAD |norm| (its sums of squares in another grouping are
    within gamma_P of it, far less)."""
    out = {k: K_FORWARD * (1 + abs(v)) for k, v in loss_terms(want).items()}
    out["loss"] = sum(out.values()) + 4 * U * abs(want["loss"]) if out else K_FORWARD * (1 + abs(want["loss"]))
    out["grad_norm"] = K_GRAD * abs(want["grad_norm"])
    return out


def sgd_weight_bound(want_rows, clip):
    """Elementwise bound on the weights of two SGD (momentum MOMENTUM) runs after their last step,
    to first order in the rounding: step s's clipped gradient c g differs by at most 2 K_GRAD
    min(|g|, clip) per element (K_GRAD of the tensor's largest element, <= |c g|, plus the clip
    coefficient's relative error, the norm's K_GRAD, times |c g_i|); its share of every later update
    is lr_t MOMENTUM^(t - s), at most lr_max / (1 - MOMENTUM) in all. Left out: the feedback of the
    weights' difference through the curvature (lr H dx, below dx for any stable step) and the
    coupled weight decay (wd dx per step)."""
    steps = sorted(want_rows)
    total = 0.0
    for i, s in enumerate(steps):
        g = want_rows[s]["grad_norm"]
        lr_max = max(want_rows[t]["lr"] for t in steps[i:])
        total += 2 * K_GRAD * (min(g, clip) if clip > 0 else g) * lr_max / (1 - MOMENTUM)
    return total


def report(label, diff, bound):
    """Prints how close a comparison came to its bound (the Verification section of TOLERANCES.md
    collects these lines)."""
    ratio = diff / bound if bound > 0 else (0.0 if diff == 0 else float("inf"))
    print(f"tolerance: {label}: |diff| {diff:.3g}, bound {bound:.3g}, ratio {ratio:.3g}", file=sys.stderr)


class RunDirTest(unittest.TestCase):
    """Runs of the mlp stand-in in a temporary folder; COMMON: the overrides every run gets."""
    COMMON = ["model.size=tiny", "train.log_every=1", "schedule.warmup_steps=2"]

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.d = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def common(self, name, *extra):
        return ["train", "--config", MLP, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                *self.COMMON, *extra]

    def assert_within(self, got, want, bound, label):
        diff = abs(got - want)
        report(label, diff, bound)
        self.assertLessEqual(diff, bound, f"{label}: {got!r} vs {want!r} (bound {bound:.3g})")

    def assert_first_step(self, got, want, label, step=1):
        """Row `got` of a split run against the reference's row `want` at the first step at the
        same weights (step 1, or the first after a resume): first_step_bounds."""
        self.assertEqual(sorted(loss_terms(got)), sorted(loss_terms(want)), label)
        for k, bound in first_step_bounds(want).items():
            self.assert_within(got[k], want[k], bound, f"{label}: step {step} {k}")

    def assert_losses(self, got, want, steps, rtol, label):
        """Losses of `steps` (rows by step, or losses by step) within rtol of the reference's."""
        for s in steps:
            a = got[s]["loss"] if isinstance(got[s], dict) else got[s]
            b = want[s]["loss"] if isinstance(want[s], dict) else want[s]
            self.assert_within(a, b, rtol * abs(b), f"{label}: step {s} loss")

    def assert_weights(self, got, want, atol, label):
        """Exported weights: the same tensors and shapes, values within atol elementwise."""
        self.assertEqual(sorted(got), sorted(want), label)
        diffs = {}
        for k in want:
            self.assertEqual(got[k].shape, want[k].shape, f"{label}: {k}")
            diffs[k] = float(np.abs(got[k].astype(np.float64) - want[k].astype(np.float64)).max(initial=0.0))
        worst = max(diffs, key=diffs.get)
        report(f"{label}: weights (worst {worst})", diffs[worst], atol)
        self.assertLessEqual(diffs[worst], atol, f"{label}: {worst}")


class TrainTest(RunDirTest):
    @classmethod
    def setUpClass(cls):
        cls.shared = tempfile.TemporaryDirectory()
        cls.cache = {}

    @classmethod
    def tearDownClass(cls):
        cls.shared.cleanup()

    def full_run(self, ranks):
        """The uninterrupted run of the exact-resume test on `ranks` ranks (8 steps, saving steps 4
        and 8), with its exported weights, trained once per class: the 2-rank one is also the
        checkpoint that test_resume_two_ranks_checkpoint_on_one_rank resumes on one rank, and the
        1-rank export the weights file of the train.load_from test. Read only: tests copy it."""
        if ranks not in self.cache:
            name = f"full{ranks}"
            run(["train", "--config", MLP, f"experiment.output_dir={self.shared.name}", f"experiment.name={name}",
                 *self.COMMON, "train.steps=8", "checkpoint.every=4"], ranks)
            full = os.path.join(self.shared.name, name)
            self.cache[ranks] = (full, weights(full))
        return self.cache[ranks]

    def check_exact_resume(self, ranks):
        full, wa = self.full_run(ranks)
        step4 = os.path.join(full, "checkpoints", "step_00000004")
        self.assertTrue(os.path.isdir(step4))
        run(self.common("resumed", "train.steps=8", f"train.resume={step4}"), ranks)
        resumed = os.path.join(self.d, "resumed")
        a = {r["step"]: r["loss"] for r in metrics(full)}
        b = {r["step"]: r["loss"] for r in metrics(resumed)}
        self.assertEqual(sorted(b), [5, 6, 7, 8])
        for s in b:
            self.assertEqual(a[s], b[s], f"loss differs at step {s} after resume")
        wb = weights(resumed)
        self.assertEqual(sorted(wa), sorted(wb))
        for k in wa:
            self.assertTrue(np.array_equal(wa[k], wb[k]), f"{k} differs after resume")

    def test_exact_resume_one_rank(self):
        self.check_exact_resume(1)

    def test_exact_resume_two_ranks(self):
        self.check_exact_resume(2)

    def test_resume_two_ranks_checkpoint_on_one_rank(self):
        # The 2-rank run of the exact-resume test, copied, continued on 1 rank from its step-4
        # checkpoint (its rows of steps 5-8 are dropped by the resume and logged again).
        dp2 = os.path.join(self.d, "dp2")
        shutil.copytree(self.full_run(2)[0], dp2)
        run(self.common("dp2", "train.steps=7", f"train.resume={dp2}/checkpoints/step_00000004"), 1)
        rows = metrics(os.path.join(self.d, "dp2"))
        self.assertEqual([r["step"] for r in rows], [1, 2, 3, 4, 5, 6, 7])
        self.assertTrue(all(np.isfinite(r["loss"]) for r in rows))
        # The 1-rank leg continued from the 2-rank weights: its first loss is close to the last one.
        self.assertLess(rows[4]["loss"], rows[0]["loss"])

    def shared_run(self):
        """A 4-step run with a profiler window (steps 2-3), without clipping, logging steps 2 and 4:
        what both the profiler test and the grad-norm test read, trained once per class."""
        if "prof" not in self.cache:
            run(["train", "--config", MLP, f"experiment.output_dir={self.shared.name}", "experiment.name=prof",
                 *self.COMMON, "train.steps=4", "train.profile_steps=2", "train.profile_start=2",
                 "train.log_every=2", "optim.grad_clip=0"])
            self.cache["prof"] = os.path.join(self.shared.name, "prof")
        return self.cache["prof"]

    def test_resume_auto_without_checkpoint_starts_fresh_and_load_from_initialises(self):
        run(self.common("fresh", "train.steps=3", "train.resume=auto"))
        src = os.path.join(self.d, "fresh")
        run(self.common("init", "train.steps=1", f"train.load_from={src}"))
        self.assertEqual([r["step"] for r in metrics(os.path.join(self.d, "init"))], [1])
        # Resubmitted with both keys, it resumes its own checkpoint (resume wins) and says so once.
        p = run(self.common("init", "train.steps=2", f"train.load_from={src}", "train.resume=auto"))
        warns = [l for l in p.stderr.splitlines() if "WARN" in l and "is ignored" in l]
        self.assertEqual(len(warns), 1, p.stderr[-3000:])
        self.assertIn(f"train.load_from '{src}' is ignored: the run resumes from '{self.d}/init/checkpoints/"
                      "step_00000001' (step 1)", warns[0])
        self.assertEqual([r["step"] for r in metrics(os.path.join(self.d, "init"))], [1, 2])
        p = run(self.common("bad", "train.steps=1", f"train.load_from={self.d}/nowhere"), check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("parallax: error:", p.stderr)

    def test_profiler_writes_a_chrome_trace_of_the_window_that_the_summary_reads(self):
        trace = os.path.join(self.shared_run(), "profile", "trace_rank0.json")
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
        names = {e.get("name", "") for e in events}
        self.assertTrue(any(n.startswith("aten::") for n in names), sorted(names)[:20])
        self.assertIn("aten::mm", names)
        p = subprocess.run([sys.executable, os.path.join(SRC, "bench", "train", "trace_summary.py"), trace,
                            "--steps", "2"], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("per step", p.stdout)
        self.assertRegex(p.stdout, r"aten::")

    def test_trace_summary_gaps_are_the_idle_time_between_kernels_of_any_stream(self):
        # Two streams: [0, 10) and [5, 15) overlap, then idle 15-20, [20, 25), idle 25-40, [40, 41).
        kernels = [("gemm_a", 0, 10, 7), ("nccl_b", 5, 10, 8), ("elementwise_c", 20, 5, 7), ("reduce_d", 40, 1, 7)]
        trace = os.path.join(self.d, "synthetic_trace.json")
        with open(trace, "w") as f:
            json.dump({"traceEvents": [{"cat": "kernel", "name": n, "ts": ts, "dur": d, "tid": tid}
                                       for n, ts, d, tid in kernels]}, f)
        p = subprocess.run([sys.executable, os.path.join(SRC, "bench", "train", "trace_summary.py"), trace,
                            "--gaps", "5"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        # Microseconds: span 41, busy 15 + 5 + 1 = 21, idle 20; printed in ms per step.
        self.assertIn("span 0.04 ms/step, busy (union over streams) 0.02 ms/step, idle 0.02 ms/step", p.stdout)
        gaps = re.findall(r"gap +(\d+) us before (\S+)", p.stdout)
        self.assertEqual(gaps, [("15", "reduce_d"), ("5", "elementwise_c")])

    def test_trace_summary_bubble_counts_nccl_kernels_as_waiting(self):
        # Compute [0, 10) and [5, 15) on two streams, a NCCL receive spinning [12, 30) (overlapping
        # compute for 3 us), compute [30, 40): span 40, compute 15 + 10 = 25, bubble 15 / 25.
        kernels = [("gemm_a", 0, 10, 7), ("elementwise_b", 5, 10, 8), ("ncclDevKernel_SendRecv", 12, 18, 9),
                   ("gemm_c", 30, 10, 7)]
        trace = os.path.join(self.d, "pp_trace.json")
        with open(trace, "w") as f:
            json.dump({"traceEvents": [{"cat": "kernel", "name": n, "ts": ts, "dur": d, "tid": tid}
                                       for n, ts, d, tid in kernels]}, f)
        p = subprocess.run([sys.executable, os.path.join(SRC, "bench", "train", "trace_summary.py"), trace,
                            "--bubble"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.strip().splitlines()[-1], "bubble 0.6000")

    def test_trace_summary_host_lead_names_what_the_host_did_during_a_gap(self):
        # Kernel "late" starts 2 us after its launch call, made at 143 after a 30 us op (112-142)
        # that covers 27 us of the idle gap 115-145 inside its parent op; kernel "early" was
        # launched 100 us ahead.
        events = [
            {"cat": "kernel", "name": "early", "ts": 100, "dur": 15, "tid": 7, "args": {"correlation": 1}},
            {"cat": "kernel", "name": "late", "ts": 145, "dur": 5, "tid": 7, "args": {"correlation": 2}},
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 3, "tid": 1, "args": {"correlation": 1}},
            {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 143, "dur": 3, "tid": 1,
             "args": {"correlation": 2}},
            {"cat": "cpu_op", "name": "ddp_hook_work", "ts": 112, "dur": 30, "tid": 1},
            {"cat": "cpu_op", "name": "backward_parent", "ts": 110, "dur": 50, "tid": 1},
            {"cat": "cpu_op", "name": "other_thread", "ts": 120, "dur": 20, "tid": 2},
        ]
        trace = os.path.join(self.d, "host_trace.json")
        with open(trace, "w") as f:
            json.dump({"traceEvents": events}, f)
        p = subprocess.run([sys.executable, os.path.join(SRC, "bench", "train", "trace_summary.py"), trace,
                            "--gaps", "3", "--host"], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("2 kernels: p10 2 us, median 100 us; 50.0% started < 50 us after launch", p.stdout)
        self.assertIn("gap       30 us before late: launched 2 us before it started; host meanwhile: "
                      "ddp_hook_work (27 of 30), backward_parent (28 of 50)", p.stdout)
        self.assertNotIn("other_thread", p.stdout)

    def test_intra_op_threads_follow_train_threads_then_omp_num_threads_then_the_affinity_mask(self):
        """train.threads=0 takes OMP_NUM_THREADS as PyTorch does (its first entry), else the cores
        this process may run on (taskset), at most the node's cores / local ranks; a bad
        OMP_NUM_THREADS is one WARN and ignored. Read from the setup line 'N CPU thread(s) per
        rank'."""
        env0 = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        cores = len(os.sched_getaffinity(0))
        first_core = str(min(os.sched_getaffinity(0)))
        cases = [({"OMP_NUM_THREADS": "3"}, [], [], 3),
                 ({"OMP_NUM_THREADS": "5,2"}, [], [], 5),
                 ({"OMP_NUM_THREADS": "3"}, ["train.threads=2"], [], 2),
                 ({}, [], [], min(cores, os.cpu_count())),
                 ({}, [], ["taskset", "-c", first_core], 1),
                 ({"OMP_NUM_THREADS": "lots"}, [], ["taskset", "-c", first_core], 1)]
        for i, (env, extra, prefix, want) in enumerate(cases):
            with self.subTest(env=env, extra=extra, prefix=prefix):
                p = subprocess.run([*prefix, PARALLAX, *self.common(f"threads{i}", "train.steps=1", *extra)],
                                   capture_output=True, text=True, timeout=120, env={**env0, **env})
                self.assertEqual(p.returncode, 0, p.stderr[-2000:])
                m = re.search(r"(\d+) CPU thread\(s\) per rank", p.stdout + p.stderr)
                self.assertIsNotNone(m, p.stderr[-2000:])
                self.assertEqual(int(m.group(1)), want)
                warned = "OMP_NUM_THREADS='lots' is not a positive integer; ignored" in p.stderr
                self.assertEqual(warned, env.get("OMP_NUM_THREADS") == "lots")

    def test_grad_norm_is_logged_without_clipping(self):
        # Without clipping the norm is computed only at log steps; it must still be there.
        rows = metrics(self.shared_run())
        self.assertEqual([r["step"] for r in rows], [2, 4])
        for r in rows:
            self.assertTrue(np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r)

    def test_nan_loss_is_a_clear_error(self):
        p = run(self.common("nan", "train.steps=5", "optim.lr=1e30", "optim.grad_clip=0"), check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertRegex(p.stderr, r"parallax: error: loss is (NaN|inf|-inf) at step \d+")

    def error_of(self, name, *extra):
        """The one error line of a failing run `name`."""
        p = run(self.common(name, "train.steps=2", *extra), check=False)
        self.assertNotEqual(p.returncode, 0)
        errors = [l for l in p.stderr.splitlines() if l.startswith("parallax: error:")]
        self.assertEqual(len(errors), 1, p.stderr[-2000:])
        return errors[0], p.stderr

    def test_load_from_weights_nan_overflow_corruption_and_no_match_are_named(self):
        # A NaN in train.load_from's weights names the file and the tensor before any step (it used
        # to surface as "loss is NaN at step 1 ... lower optim.lr").
        # Any weights of the model: the exact-resume test's export (a copy: the variants are made
        # from it).
        full, _ = self.full_run(1)
        w = os.path.join(self.d, "src.h5")
        shutil.copy(os.path.join(full, "export", "weights.h5"), w)
        with h5py.File(w, "r") as f:
            keys = sorted(k for k in f if isinstance(f[k], h5py.Dataset))
            name = [k for k in keys if f[k].ndim == 2][0]

        def variant(label, change):
            path = os.path.join(self.d, f"{label}.h5")
            shutil.copy(w, path)
            change(path)
            return path

        def one_nan(a):
            a.flat[1] = np.nan
            return a

        nan = variant("nan", lambda p: rewrite_tensor(p, name, one_nan))
        error, stderr = self.error_of("nanbase", f"train.load_from={nan}")
        self.assertIn(f"train.load_from '{nan}': tensor '{name}' holds 1 NaN", error)
        self.assertNotIn("at step", stderr)
        # Finite values that overflow in the forward: the first step's non-finite loss names the
        # loaded weights, not the learning rate (no update has happened).
        big = variant("big", lambda p: rewrite_tensor(p, name, lambda a: np.full_like(a, 3e38)))
        error, _ = self.error_of("bigbase", f"train.load_from={big}")
        self.assertRegex(error, r"loss is (NaN|inf|-inf) at step 1 ")
        self.assertIn(f"no update has happened yet, so the weights loaded from train.load_from '{big}' are the "
                      "likely cause", error)
        self.assertNotIn("optim.lr", error)
        # weights.h5 carries a crc32 per tensor, which h5py reads: a byte flipped inside a tensor's data
        # is refused naming the file and the tensor.
        with h5py.File(w, "r") as f:
            self.assertEqual(int(f[name].attrs["crc32"]), zlib.crc32(f[name][()].tobytes()))
        flipped = variant("flipped", lambda p: flip_byte(p, name))
        error, _ = self.error_of("flipped", f"train.load_from={flipped}")
        self.assertIn(f"weights file '{flipped}': checksum mismatch for tensor '{name}'", error)
        # A file written before the checksums (format version 1) still loads, with one warning.
        def strip(p):
            with h5py.File(p, "r+") as f:
                f.attrs["format_version"] = 1
                for k in f:
                    del f[k].attrs["crc32"]
        old = variant("old", strip)
        p = run(self.common("oldbase", "train.steps=1", f"train.load_from={old}"))
        warns = [l for l in p.stderr.splitlines() if "WARN" in l]
        self.assertEqual(len(warns), 1, p.stderr[-2000:])
        self.assertIn(f"weights file '{old}' holds no checksums", warns[0])
        # Non-strict loading that matches nothing is refused, naming some keys of both sides.
        foreign = os.path.join(self.d, "foreign.h5")
        with h5py.File(foreign, "w") as f:
            for k in ("decoder.fc.bias", "decoder.fc.weight", "encoder.conv.bias", "encoder.conv.weight", "z"):
                f[k] = np.ones(3, np.float32)
        error, _ = self.error_of("foreign", f"train.load_from={foreign}", "train.strict_load=false")
        self.assertIn(f"'{foreign}': nothing matched the module (non-strict loading would load 0 of its", error)
        self.assertIn("it holds decoder.fc.bias, decoder.fc.weight, encoder.conv.bias, encoder.conv.weight, ... "
                      "(5 in all); the module has ", error)
        self.assertIn(f"the module has {', '.join(keys[:4])}, ...", error)

    def test_cuda_graph_on_the_cpu_is_refused_naming_the_key(self):
        # The GPU side (graph against eager, 1 and 2 GPUs) is tests/train/test_cuda_graph.py.
        p = run(self.common("graph", "train.steps=2", "train.device=cpu", "train.cuda_graph=true"), check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("parallax: error: key 'train.cuda_graph': CUDA graphs need a GPU", p.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.d, "graph", "metrics.jsonl")) and
                         metrics(os.path.join(self.d, "graph")))

    def test_bev_tiny_trains_evaluates_checkpoints_on_two_ranks(self):
        data = os.path.join(self.d, "data")
        # Small images and few scenes: what is checked is that each stage runs and logs, not the
        # model's accuracy (4 scenes feed 3 steps of 2 x 2 samples: the sampler starts a new epoch).
        run(["datagen", "--out", data, "--scenes", "4", "--val-scenes", "2", "--threads", "2",
             "--samples-per-pixel", "1", "--height", "64", "--width", "112"])
        trained = run(["train", "--config", BEV, f"experiment.output_dir={self.d}", "experiment.name=bev",
             f"data.path={data}", "data.batch_size=2", "train.steps=3", "train.log_every=1",
             "train.eval_every=2", "train.activation_checkpointing=full", "precision.mode=bf16",
             "schedule.warmup_steps=1"], ranks=2)
        run_dir = os.path.join(self.d, "bev")
        train = metrics(run_dir)
        self.assertEqual([r["step"] for r in train], [1, 2, 3])
        for k in ("loss", "lr", "grad_norm", "step_ms", "data_ms", "comm_exposed_ms", "img_per_s", "mem_gb"):
            self.assertIn(k, train[-1])
        self.assertTrue(any(k.startswith("loss_") for k in train[-1]))
        evals = metrics(run_dir, "eval")
        self.assertEqual([r["step"] for r in evals], [2, 3])
        for k in ("val_loss", "miou", "iou_vehicle", "map", "map_2m", "map_0.5m", "ap_2m_vehicle"):
            self.assertIn(k, evals[-1])
        p = run(["inspect", run_dir])
        self.assertIn("step", p.stdout)
        self.assertTrue(os.path.exists(os.path.join(run_dir, "plots", "loss.png")), trained.stderr[-3000:])

    def test_a_dataset_without_the_val_split_trains_without_evaluation_or_fails_before_step_1(self):
        data = os.path.join(self.d, "data")
        run(["datagen", "--out", data, "--scenes", "4", "--val-scenes", "0", "--threads", "2",
             "--samples-per-pixel", "1", "--height", "64", "--width", "112"])
        common = ["train", "--config", BEV, f"experiment.output_dir={self.d}", f"data.path={data}",
                  "data.batch_size=2", "train.steps=1", "schedule.warmup_steps=1", "train.device=cpu"]
        # Only the final evaluation asked for (train.eval_every=0): trained, a warning, exit 0.
        p = run([*common, "experiment.name=final_only", "train.eval_every=0"])
        self.assertIn("has no split 'val' (data.val_split; its splits: train): no evaluation", p.stderr)
        self.assertEqual(metrics(os.path.join(self.d, "final_only"), "eval"), [])
        # Periodic evaluation asked for: refused before any step, naming the key.
        p = run([*common, "experiment.name=periodic", "train.eval_every=1"], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("parallax: error: key 'data.val_split': dataset", p.stderr)
        self.assertNotIn("step 1/", p.stderr)


if __name__ == "__main__":
    PARALLAX = os.path.abspath(sys.argv.pop(1))
    MPIRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
