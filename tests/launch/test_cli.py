#!/usr/bin/env python3
"""End-to-end tests of the `parallax` binary: help, errors (one line, non-zero exit), config
printing with overrides, and a short training run's outputs. Usage: test_cli.py <parallax>."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import yaml

PARALLAX = None
SRC = os.environ.get("PARALLAX_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


def run(*args, cwd=None):
    p = subprocess.run([PARALLAX, *args], capture_output=True, text=True, cwd=cwd, timeout=300)
    return p.returncode, p.stdout, p.stderr


class CliTest(unittest.TestCase):
    def assert_one_error_line(self, rc, err, *needles):
        self.assertNotEqual(rc, 0)
        lines = [l for l in err.splitlines() if l.strip()]
        self.assertEqual(len(lines), 1, f"expected one error line, got: {err!r}")
        self.assertTrue(lines[0].startswith("parallax: error: "), lines[0])
        for n in needles:
            self.assertIn(n, lines[0])

    def test_top_level_help_lists_working_verbs(self):
        rc, out, _ = run("--help")
        self.assertEqual(rc, 0)
        self.assertIn("usage: parallax <verb>", out)
        self.assertIn("train", out)

    def test_train_help(self):
        rc, out, _ = run("train", "--help")
        self.assertEqual(rc, 0)
        for s in ("--config FILE", "--print-config", "key=value", "examples:"):
            self.assertIn(s, out)

    def test_missing_config_is_one_clear_line(self):
        rc, _, err = run("train", "--config", "nope.yaml")
        self.assert_one_error_line(rc, err, "config file 'nope.yaml' not found")

    def test_unknown_verb_and_option_suggest(self):
        rc, _, err = run("trian")
        self.assert_one_error_line(rc, err, "unknown verb 'trian'", "did you mean 'train'?")
        rc, _, err = run("train", "--confg", "x.yaml")
        self.assert_one_error_line(rc, err, "unknown option '--confg'", "did you mean '--config'?")
        rc, _, err = run("train")
        self.assert_one_error_line(rc, err, "--config FILE is required")

    def test_print_config_applies_bases_and_overrides(self):
        cfg = os.path.join(SRC, "configs", "mlp_demo.yaml")
        rc, out, err = run("train", "--config", cfg, "optim.lr=3e-4", "optim.betas=[0.8,0.9]",
                           "parallel.dp=2", "train.grad_accum=4", "--print-config")
        self.assertEqual(rc, 0, err)
        c = yaml.safe_load(out)
        # Exact: the override's text comes back as given, and float() rounds it as the literal is.
        self.assertEqual(float(c["optim"]["lr"]), 3e-4)
        self.assertEqual([float(b) for b in c["optim"]["betas"]], [0.8, 0.9])
        self.assertEqual(int(c["parallel"]["dp"]), 2)
        self.assertEqual(int(c["train"]["grad_accum"]), 4)
        self.assertEqual(c["experiment"]["name"], "mlp_demo")       # from the file
        self.assertEqual(c["optim"]["name"], "adamw")                # from its base
        self.assertEqual(set(c), {"experiment", "model", "data", "parallel", "precision", "optim",
                                  "schedule", "train", "checkpoint", "export"})

    def test_bad_override_and_bad_file_name_the_key(self):
        cfg = os.path.join(SRC, "configs", "mlp_demo.yaml")
        rc, _, err = run("train", "--config", cfg, "optim.lrr=1")
        self.assert_one_error_line(rc, err, "unknown key 'optim.lrr'", "did you mean 'optim.lr'?")
        with tempfile.TemporaryDirectory() as d:
            bad = os.path.join(d, "bad.yaml")
            with open(bad, "w") as f:
                f.write("train:\n  steps: [1,\n")
            rc, _, err = run("train", "--config", bad)
            self.assert_one_error_line(rc, err, "bad.yaml:", "malformed YAML")
            wrong = os.path.join(d, "wrong.yaml")
            with open(wrong, "w") as f:
                f.write("train:\n  steps: lots\n")
            rc, _, err = run("train", "--config", wrong)
            self.assert_one_error_line(rc, err, "wrong.yaml:2", "key 'train.steps' expects an integer, got 'lots'")

    def test_help_config_lists_keys(self):
        rc, out, _ = run("train", "--help-config")
        self.assertEqual(rc, 0)
        self.assertIn("optim.lr", out)
        self.assertIn("parallel.ddp.bucket_mb", out)

    def test_short_training_writes_resolved_config_and_metrics(self):
        cfg = os.path.join(SRC, "configs", "mlp_demo.yaml")
        with tempfile.TemporaryDirectory() as d:
            rc, out, err = run("train", "--config", cfg, f"experiment.output_dir={d}",
                               "experiment.name=t", "train.steps=6", "train.log_every=2",
                               "model.size=tiny")
            self.assertEqual(rc, 0, err)
            run_dir = os.path.join(d, "t")
            with open(os.path.join(run_dir, "config.yaml")) as f:
                resolved = yaml.safe_load(f)
            self.assertEqual(int(resolved["train"]["steps"]), 6)
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                rows = [json.loads(l) for l in f if l.strip()]
            self.assertEqual([r["step"] for r in rows if r["kind"] == "train"], [2, 4, 6])
            self.assertEqual(rows[-1]["kind"], "summary")
            for r in rows[:-1]:
                for k in ("loss", "lr", "step_ms", "img_per_s"):
                    self.assertIn(k, r)


if __name__ == "__main__":
    PARALLAX = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
