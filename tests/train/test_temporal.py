#!/usr/bin/env python3
"""The temporal bev model (model.temporal.frames = 2) under every engine against one process, on
synthetic in-memory batches (each sample with its previous keyframe and the ego motion), 2 SGD
steps, conv backbone unless said:

- DDP and ZeRO-3 (deferred init) on 2 ranks with 1 sample each against one process with 2: step 1
  within tt.first_step_bounds, step 2 within 1e-4 relative (kind N, tests/TOLERANCES.md: the
  step-1 gradient's rounding through one SGD step); ZeRO-3's step 1 is DDP's bit for bit (same
  weights, same per-rank forward);
- the pipeline (2 stages: the frames travel with the micro-batch): step 1 bit for bit (the same
  forward), step 2 within 1e-4 (the micro-batches' gradients summed in another order);
- full activation checkpointing: the same arithmetic in the same order, bit for bit;
- tensor parallelism on the ViT backbone (tp 2) against one process with the ViT backbone:
  step 1 within tt.first_step_bounds, step 2 within 1e-4;
- prev_grad=true (backpropagating through the previous frame) under the pipeline and ZeRO-3 against
  one process, as above;
- on a generated sequence dataset (datagen --sequence-length 4) with data.frames = 2, the velocity
  head and class-balanced sampling: 2 ranks train, evaluate (mAVE, NDS) and resume exactly;
- one line each: data.frames and model.temporal.frames that differ, data.frames on a dataset of
  independent scenes, data.frames longer than the sequences.

Usage: test_temporal.py <parallax binary> <mpirun>
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train as tt  # noqa: E402  (shared helpers: run, rows, first-step bounds)

RTOL = 1e-4


class TemporalTest(tt.RunDirTest):
    def bev(self, name, ranks, *extra):
        tt.run(["train", "--config", tt.BEV, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                "model.backbone=conv", "model.temporal.frames=2", "data.synthetic=true", "train.device=cpu",
                "train.steps=2", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0",
                "schedule.warmup_steps=1", *tt.sgd(1e-2), *extra], ranks=ranks)
        rows = tt.rows(os.path.join(self.d, name))
        self.assertEqual(sorted(rows), [1, 2], name)
        return rows

    def test_ddp_zero3_pipeline_and_checkpointing_match_one_process(self):
        one = self.bev("one", 1, "data.batch_size=2")
        ddp = self.bev("ddp", 2, "data.batch_size=1")
        z3 = self.bev("z3", 2, "data.batch_size=1", "parallel.zero.stage=3")
        pp = self.bev("pp", 2, "data.batch_size=2", "parallel.pp=2")
        ac = self.bev("ac", 1, "data.batch_size=2", "train.activation_checkpointing=full")
        self.assert_first_step(ddp[1], one[1], "temporal DDP vs one process")
        self.assert_losses(ddp, one, [2], RTOL, "temporal DDP vs one process")
        self.assertEqual(z3[1]["loss"], ddp[1]["loss"], "ZeRO-3 step 1 differs from DDP")
        self.assert_losses(z3, one, [2], RTOL, "temporal ZeRO-3 vs one process")
        for s in (1, 2):
            self.assertEqual(ac[s]["loss"], one[s]["loss"], f"activation checkpointing step {s}")
        self.assertEqual(pp[1]["loss"], one[1]["loss"], "pipeline step 1")
        self.assert_losses(pp, one, [2], RTOL, "temporal pipeline vs one process")

    def test_tensor_parallel_vit_backbone_matches_one_process(self):
        one = self.bev("vone", 1, "model.backbone=vit", "data.batch_size=2")
        tp = self.bev("tp", 2, "model.backbone=vit", "data.batch_size=2", "parallel.tp=2")
        self.assert_first_step(tp[1], one[1], "temporal tp 2 vs one process")
        self.assert_losses(tp, one, [2], RTOL, "temporal tp 2 vs one process")

    def test_prev_grad_under_pipeline_and_zero3(self):
        one = self.bev("gone", 1, "data.batch_size=2", "model.temporal.prev_grad=true")
        pp = self.bev("gpp", 2, "data.batch_size=2", "parallel.pp=2", "model.temporal.prev_grad=true")
        z3 = self.bev("gz3", 2, "data.batch_size=1", "parallel.zero.stage=3", "model.temporal.prev_grad=true")
        self.assertEqual(pp[1]["loss"], one[1]["loss"], "prev_grad pipeline step 1")
        self.assert_losses(pp, one, [2], RTOL, "prev_grad pipeline vs one process")
        self.assert_first_step(z3[1], one[1], "prev_grad ZeRO-3 vs one process")
        self.assert_losses(z3, one, [2], RTOL, "prev_grad ZeRO-3 vs one process")
        # The previous frame's gradient reaches the backbone: another step-2 loss than without.
        nograd = self.bev("gref", 1, "data.batch_size=2")
        self.assertEqual(nograd[1]["loss"], one[1]["loss"])
        self.assertNotEqual(nograd[2]["loss"], one[2]["loss"])

    def test_generated_sequences_train_evaluate_and_resume(self):
        data = os.path.join(self.d, "seq")
        tt.run(["datagen", "--out", data, "--scenes", "16", "--val-scenes", "8", "--sequence-length", "4",
                "--cameras", "2", "--height", "64", "--width", "112", "--samples-per-pixel", "1"])
        common = ["train", "--config", tt.BEV, f"experiment.output_dir={self.d}", f"data.path={data}",
                  "model.backbone=conv", "model.temporal.frames=2", "data.frames=2", "model.velocity=true",
                  "data.sampler=cbgs", "data.batch_size=1", "data.num_workers=1", "train.device=cpu",
                  "train.log_every=1", "train.eval_every=0", *tt.sgd(1e-2)]
        tt.run([*common, "experiment.name=full", "train.steps=4", "checkpoint.every=2", "train.eval_every=4"], ranks=2)
        run_dir = os.path.join(self.d, "full")
        ev = tt.metrics(run_dir, "eval")
        self.assertEqual(len(ev), 1)
        for key in ("map", "ave", "aae", "nds", "nds_no_aae"):
            self.assertIn(key, ev[0])
        step2 = os.path.join(run_dir, "checkpoints", "step_00000002")
        tt.run([*common, "experiment.name=resumed", "train.steps=4", f"train.resume={step2}"], ranks=2)
        a, b = tt.losses(run_dir), tt.losses(os.path.join(self.d, "resumed"))
        self.assertEqual(sorted(b), [3, 4])
        for s in b:
            self.assertEqual(a[s], b[s], f"step {s}")
        # Bad combinations: one line each, naming the keys.
        plain = os.path.join(self.d, "plain")
        tt.run(["datagen", "--out", plain, "--scenes", "4", "--val-scenes", "1", "--cameras", "2", "--height", "64",
                "--width", "112", "--samples-per-pixel", "1"])
        cases = [(["data.frames=1"], "'data.frames' (1) and 'model.temporal.frames' (2) differ"),
                 ([f"data.path={plain}"], "holds independent scenes"),
                 (["data.frames=5", "model.temporal.frames=5"], "longer than the dataset's sequences")]
        for extra, needle in cases:
            p = tt.run([*common, "experiment.name=bad", "train.steps=1", *extra], check=False)
            self.assertNotEqual(p.returncode, 0, extra)
            self.assertIn(needle, p.stderr)
            self.assertEqual(len([l for l in p.stderr.splitlines() if l.startswith("parallax: error:")]), 1, extra)


if __name__ == "__main__":
    tt.PARALLAX, tt.MPIRUN = os.path.abspath(sys.argv[1]), sys.argv[2]
    unittest.main(argv=[sys.argv[0], *sys.argv[3:]], verbosity=2)
