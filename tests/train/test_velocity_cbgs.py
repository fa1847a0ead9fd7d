#!/usr/bin/env python3
"""The velocity head (model.velocity) and class-balanced sampling (data.sampler=cbgs) through the
real `parallax` binary, on a small generated dataset:

- a run with both trains, logs the class-balanced epoch ("data.sampler=cbgs: N slots per epoch"),
  evaluates and exports to ONNX with the 10-channel box_reg through the parity gate;
- a run resumed from its step-2 checkpoint continues the class-balanced epoch exactly: the same
  losses as the run that went straight through (the sampler is a pure function of seed and
  epoch, and the loader's position is checkpointed);
- two MPI ranks under DDP take disjoint class-balanced slots and train;
- an unknown sampler is one line naming the key.

Usage: test_velocity_cbgs.py <parallax binary> <mpirun>
"""
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train as tt  # noqa: E402  (shared helpers: run, losses)

DATA = None


class VelocityCbgsTest(tt.RunDirTest):
    def bev(self, name, *extra):
        return ["train", "--config", tt.BEV, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                f"data.path={DATA}", "model.backbone=conv", "model.velocity=true", "data.sampler=cbgs",
                "data.batch_size=2", "data.num_workers=1", "train.device=cpu", "train.log_every=1",
                "train.eval_every=0", *extra]

    def test_train_eval_and_export(self):
        p = tt.run(self.bev("a", "train.steps=2", "train.eval_every=2"))
        log = p.stdout + p.stderr
        self.assertRegex(log, r"class-balanced, data\.sampler=cbgs: \d+ slots per epoch")
        run_dir = os.path.join(self.d, "a")
        self.assertEqual(sorted(tt.losses(run_dir)), [1, 2])
        evals = tt.metrics(run_dir, "eval")
        self.assertEqual(len(evals), 1)
        with open(os.path.join(run_dir, "config.yaml")) as f:
            cfg = f.read()
        self.assertIn("velocity: true", cfg)
        self.assertIn("sampler: cbgs", cfg)
        q = tt.run(["export", "--run", run_dir, "--format", "onnx", "--parity-frames", "2"])
        out = q.stdout + q.stderr
        self.assertIn("PASS", out)
        self.assertIn("box_reg cos", out)

    def test_resume_continues_the_class_balanced_epoch_exactly(self):
        common = ["optim.name=sgd", "optim.lr=0.01", "schedule.warmup_steps=0"]
        tt.run(self.bev("full", "train.steps=4", "checkpoint.every=2", *common))
        step2 = os.path.join(self.d, "full", "checkpoints", "step_00000002")
        self.assertTrue(os.path.isdir(step2))
        tt.run(self.bev("resumed", "train.steps=4", f"train.resume={step2}", *common))
        a, b = tt.losses(os.path.join(self.d, "full")), tt.losses(os.path.join(self.d, "resumed"))
        self.assertEqual(sorted(b), [3, 4])
        for s in b:
            self.assertEqual(a[s], b[s], f"step {s}")

    def test_two_ranks_train_on_disjoint_slots(self):
        p = tt.run(self.bev("dp", "train.steps=2"), ranks=2)
        self.assertIn("class-balanced", p.stdout + p.stderr)
        self.assertEqual(sorted(tt.losses(os.path.join(self.d, "dp"))), [1, 2])

    def test_an_unknown_sampler_is_one_line_naming_the_key(self):
        p = tt.run(self.bev("bad", "train.steps=1", "data.sampler=balanced"), check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("data.sampler", p.stderr)
        self.assertEqual(len([l for l in p.stderr.splitlines() if l.startswith("parallax: error:")]), 1)


if __name__ == "__main__":
    tt.PARALLAX, tt.MPIRUN = os.path.abspath(sys.argv[1]), sys.argv[2]
    with tempfile.TemporaryDirectory() as data_dir:
        DATA = os.path.join(data_dir, "ds")
        tt.run(["datagen", "--out", DATA, "--scenes", "12", "--val-scenes", "2", "--cameras", "2", "--height", "64",
                "--width", "112", "--samples-per-pixel", "1"])
        unittest.main(argv=[sys.argv[0], *sys.argv[3:]], verbosity=2)
