#!/usr/bin/env python3
"""Distillation through the real `parallax` binary (issue 21, the distill part):

- a bev_tiny teacher (ViT backbone) trains, then a bev_tiny student (conv backbone) distils from
  its run directory: metrics.jsonl holds loss_seg_kl, loss_heatmap and loss_feature beside the
  task terms, and the student's total loss falls;
- the same under DDP on 2 ranks;
- bitwise resume: 3 steps, then 3 more from the checkpoint, equal the 6-step run (losses and
  exported weights);
- bad inputs are one `parallax: error:` line naming the key.

Usage: test_distill.py <parallax binary> <mpirun>
"""
import os
import shutil
import sys
import unittest

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train as tt  # noqa: E402  (shared helpers: run, metrics, weights)


class DistillTest(tt.RunDirTest):
    COMMON = ["train.log_every=1", "train.device=cpu", "data.synthetic=true", "data.batch_size=2",
              "schedule.name=constant", "schedule.warmup_steps=1"]

    def bev(self, name, ranks, *extra, check=True):
        args = ["train", "--config", tt.BEV, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                *self.COMMON, *extra]
        return tt.run(args, ranks, check=check)

    def setUp(self):
        super().setUp()
        self.bev("teacher", 1, "model.backbone=vit", "train.steps=4")
        self.teacher = os.path.join(self.d, "teacher")
        self.distill = [f"distill.teacher={self.teacher}", "distill.teacher_backbone=vit"]

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
        self.bev("full", 1, "train.steps=6", *self.distill)
        self.bev("half", 1, "train.steps=3", "checkpoint.every=3", *self.distill)
        shutil.copytree(os.path.join(self.d, "half"), os.path.join(self.d, "resumed"))
        self.bev("resumed", 1, "train.steps=6", "train.resume=auto", *self.distill)
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
        # 1 ... lower optim.lr").
        w = os.path.join(self.teacher, "export", "weights.h5")
        tt.run(["export", "--run", self.teacher, "--format", "weights"])
        with h5py.File(w, "r") as f:
            name = sorted(k for k in f if k.endswith(".weight"))[0]

        def inf_first(a):
            a.flat[0] = np.inf
            return a

        tt.rewrite_tensor(w, name, inf_first)
        cases.append(([f"distill.teacher={w}", "distill.teacher_backbone=vit"],
                      f"distill.teacher '{w}': tensor '{name}' holds 0 NaN and 1 infinite value(s)"))
        for extra, needle in cases:
            p = self.bev("bad", 1, "train.steps=1", *extra, check=False)
            self.assertNotEqual(p.returncode, 0, extra)
            errors = [line for line in p.stderr.splitlines() if line.startswith("parallax: error:")]
            self.assertTrue(errors, f"{extra}: {p.stderr[-2000:]}")
            self.assertIn(needle, errors[0], extra)


if __name__ == "__main__":
    tt.PARALLAX = os.path.abspath(sys.argv.pop(1))
    tt.MPIRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
