#!/usr/bin/env python3
"""Distillation through the real `parallax` binary (issue 21, the distill part):

- a bev_tiny teacher (ViT backbone) trains, then a bev_tiny student (conv backbone) distils from
  its run directory: metrics.jsonl holds loss_seg_kl, loss_heatmap and loss_feature beside the
  task terms, and the student's total loss falls;
- the same under DDP on 2 ranks;
- bitwise resume: 2 steps, then 2 more from the checkpoint, equal the 4-step run (losses and
  exported weights);
- bad inputs are one `parallax: error:` line naming the key.

CI time (2 cores): what each run costs beyond what the assertions read.
- The teacher is trained once per file (setUpClass), in a folder of its own that no test writes
  into (the NaN teacher is exported with --out into the test's folder); it used to be trained
  again for every test.
- The trainer's plots (tools/plot_metrics.py, ~1 s of CPU per run) are not drawn: no test here
  reads them (test_train.py does). PARALLAX_PYTHON, the interpreter the trainer runs them with, is
  a script that skips that tool for this file's runs (tt.SkippedPlots).
- The bad-input runs, each refused before any step, go side by side.

Usage: test_distill.py <parallax binary> <mpirun>
"""
import concurrent.futures
import os
import shutil
import sys
import tempfile
import unittest

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train as tt  # noqa: E402  (shared helpers: run, metrics, weights)


PLOTS = tt.SkippedPlots()  # no plots (above)


def setUpModule():
    PLOTS.start()


def tearDownModule():
    PLOTS.stop()


class DistillTest(tt.RunDirTest):
    COMMON = ["train.log_every=1", "train.device=cpu", "data.synthetic=true", "data.batch_size=2",
              "schedule.name=constant", "schedule.warmup_steps=1"]

    @classmethod
    def run_bev(cls, out_dir, name, ranks, *extra, check=True):
        args = ["train", "--config", tt.BEV, f"experiment.output_dir={out_dir}", f"experiment.name={name}",
                *cls.COMMON, *extra]
        return tt.run(args, ranks, check=check)

    def bev(self, name, ranks, *extra, check=True):
        return self.run_bev(self.d, name, ranks, *extra, check=check)

    @classmethod
    def setUpClass(cls):
        # The teacher every test distils from, trained once (no test writes into its folder).
        cls.shared = tempfile.TemporaryDirectory()
        cls.run_bev(cls.shared.name, "teacher", 1, "model.backbone=vit", "train.steps=4")
        cls.teacher = os.path.join(cls.shared.name, "teacher")
        cls.distill = [f"distill.teacher={cls.teacher}", "distill.teacher_backbone=vit"]

    @classmethod
    def tearDownClass(cls):
        cls.shared.cleanup()

    def test_student_learns_from_the_teacher_on_one_and_two_ranks(self):
        for ranks in (1, 2):
            name = f"student{ranks}"
            # distill.seg_kl=1: every bev term (the KL is off by default, docs/trainers.md).
            self.bev(name, ranks, "train.steps=8", "optim.lr=3e-3", "distill.seg_kl=1", *self.distill)
            rows = tt.metrics(os.path.join(self.d, name))
            self.assertEqual([r["step"] for r in rows], list(range(1, 9)))
            for r in rows:
                for k in ("loss_seg_kl", "loss_heatmap", "loss_feature", "loss_seg_ce"):
                    self.assertIn(k, r)
                    self.assertTrue(np.isfinite(r[k]), (k, r))
            first, last = rows[0]["loss"], rows[-1]["loss"]
            self.assertLess(last, first, f"{ranks} rank(s): the loss did not fall ({first} -> {last})")
        # The export holds the student only (no teacher, no projection).
        w = tt.weights(os.path.join(self.d, "student1"))
        self.assertTrue(any(k.startswith("encoder.conv") for k in w))
        self.assertFalse(any(k.startswith("aux") or "vit" in k for k in w), sorted(w)[:5])

    def test_resume_is_bitwise(self):
        # 2 steps after the resume: the first runs on the restored weights and AdamW moments, the
        # second on the moments the resumed run updated itself (was 3 + 3 steps).
        self.bev("full", 1, "train.steps=4", *self.distill)
        self.bev("half", 1, "train.steps=2", "checkpoint.every=2", *self.distill)
        shutil.copytree(os.path.join(self.d, "half"), os.path.join(self.d, "resumed"))
        self.bev("resumed", 1, "train.steps=4", "train.resume=auto", *self.distill)
        full = {r["step"]: r["loss"] for r in tt.metrics(os.path.join(self.d, "full"))}
        resumed = {r["step"]: r["loss"] for r in tt.metrics(os.path.join(self.d, "resumed"))}
        self.assertEqual(resumed, full)
        wf, wr = tt.weights(os.path.join(self.d, "full")), tt.weights(os.path.join(self.d, "resumed"))
        self.assertEqual(sorted(wf), sorted(wr))
        for k in wf:
            self.assertTrue(np.array_equal(wf[k], wr[k]), k)

    def test_bad_inputs_are_one_clear_error(self):
        cases = [
            (["distill.teacher=/nonexistent/run"], "distill.teacher"),
            ([*self.distill, "distill.heatmap=0", "distill.feature=0"], "every weight is 0"),
            ([*self.distill, "parallel.zero.stage=3"], "parallel.zero.stage"),
            ([f"distill.teacher={self.teacher}", "distill.teacher_backbone=conv"], "encoder."),
            ([*self.distill, "lora.rank=4"], "lora.rank"),
        ]
        # A teacher holding NaN is named at load time (it used to surface as "loss is NaN at step
        # 1 ... lower optim.lr"). Exported into this test's folder: the shared teacher stays as
        # it is.
        w = os.path.join(self.d, "teacher_weights.h5")
        tt.run(["export", "--run", self.teacher, "--format", "weights", "--out", w])
        with h5py.File(w, "r") as f:
            name = sorted(k for k in f if k.endswith(".weight"))[0]

        def inf_first(a):
            a.flat[0] = np.inf
            return a

        tt.rewrite_tensor(w, name, inf_first)
        cases.append(([f"distill.teacher={w}", "distill.teacher_backbone=vit"],
                      f"distill.teacher '{w}': tensor '{name}' holds 0 NaN and 1 infinite value(s)"))
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            runs = [pool.submit(self.bev, f"bad{i}", 1, "train.steps=1", *extra, check=False)
                    for i, (extra, _) in enumerate(cases)]
        for (extra, needle), run in zip(cases, runs):
            p = run.result()
            self.assertNotEqual(p.returncode, 0, extra)
            errors = [line for line in p.stderr.splitlines() if line.startswith("parallax: error:")]
            self.assertTrue(errors, f"{extra}: {p.stderr[-2000:]}")
            self.assertIn(needle, errors[0], extra)


if __name__ == "__main__":
    tt.PARALLAX = os.path.abspath(sys.argv.pop(1))
    tt.MPIRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
