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
  one process, as above.

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


if __name__ == "__main__":
    tt.PARALLAX, tt.MPIRUN = os.path.abspath(sys.argv[1]), sys.argv[2]
    unittest.main(argv=[sys.argv[0], *sys.argv[3:]], verbosity=2)
