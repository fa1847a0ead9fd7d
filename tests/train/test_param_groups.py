#!/usr/bin/env python3
"""Parameter groups (optim.param_groups, optim.layer_decay) through the real `parallax` binary:

- the start table lists each rule with its parameters, lr multipliers and weight decay;
- a resume whose groups changed warns once per changed group on rank 0 ("optim.param_groups[0]
  'encoder.*': lr_mult 0.1 in the checkpoint, 0.5 now"), and goes on; a newly frozen group's
  optimizer state in the checkpoint is skipped;
- a rule that matches no parameter, and layer_decay on a model without layers, stop the run naming
  the key.

bev tiny with its ViT backbone on synthetic data, 2 + 2 steps on one rank.

Usage: test_param_groups.py <parallax binary> <mpirun>
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train as tt  # noqa: E402  (shared helpers: run, metrics)


class ParamGroupsTest(tt.RunDirTest):
    def bev(self, name, *extra):
        return ["train", "--config", tt.BEV, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                "model.backbone=vit", "data.synthetic=true", "data.batch_size=1", "train.device=cpu",
                "train.log_every=1", "train.eval_every=0", "schedule.warmup_steps=0", *extra]

    def test_resume_with_changed_groups_warns_per_group_and_goes_on(self):
        groups = "optim.param_groups=[{match: 'encoder.*', lr_mult: 0.1}, {match: 'heads.*', lr_mult: 1.0}]"
        p = tt.run(self.bev("g", groups, "optim.layer_decay=0.75", "train.steps=2", "checkpoint.every=2"))
        log = p.stdout + p.stderr
        # The start table: both rules, the default row, lr multipliers with the layer scales.
        self.assertIn("parameter groups", log)
        self.assertRegex(log, r"\[0\]\s+encoder\.\*\s+\d+\s+\d+\s+0\.0421875 \.\. 0\.1\s")
        self.assertRegex(log, r"\[1\]\s+heads\.\*\s+\d+\s+\d+\s+1\s")
        self.assertIn("(default)", log)
        run_dir = os.path.join(self.d, "g")
        self.assertEqual(sorted(tt.losses(run_dir)), [1, 2])

        # Same groups: no group warning.
        same = tt.run(self.bev("g", groups, "optim.layer_decay=0.75", "train.steps=3", "train.resume=auto"))
        self.assertNotIn("in the checkpoint,", same.stdout + same.stderr)

        # lr_mult of rule 0 changed, rule 1 now frozen: one warning each, and the run goes on (the
        # frozen group's optimizer state in the checkpoint is skipped).
        changed = "optim.param_groups=[{match: 'encoder.*', lr_mult: 0.5}, {match: 'heads.*', frozen: true}]"
        step2 = os.path.join(run_dir, "checkpoints", "step_00000002")
        q = tt.run(self.bev("g", changed, "optim.layer_decay=0.75", "train.steps=4", f"train.resume={step2}"))
        log = q.stdout + q.stderr
        self.assertEqual(log.count("optim.param_groups[0] 'encoder.*': lr_mult 0.1 in the checkpoint, 0.5 now"), 1,
                         log[-3000:])
        self.assertEqual(log.count("optim.param_groups[1] 'heads.*': frozen false in the checkpoint, true now"), 1,
                         log[-3000:])
        self.assertNotIn("optim.layer_decay:", log)
        self.assertEqual(sorted(tt.losses(run_dir))[-2:], [3, 4])

    def test_a_rule_that_matches_nothing_and_layer_decay_without_layers_are_refused(self):
        p = tt.run(self.bev("typo", "optim.param_groups=[{match: 'encodr.*', lr_mult: 0.1}]", "train.steps=1"),
                   check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("optim.param_groups[0].match", p.stderr)
        q = tt.run(self.bev("conv", "model.backbone=conv", "optim.layer_decay=0.75", "train.steps=1"), check=False)
        self.assertNotEqual(q.returncode, 0)
        self.assertIn("optim.layer_decay", q.stderr)
        self.assertIn("backbone 'conv'", q.stderr)


if __name__ == "__main__":
    tt.PARALLAX = os.path.abspath(sys.argv.pop(1))
    tt.MPIRUN = sys.argv.pop(1)
    unittest.main(verbosity=2)
