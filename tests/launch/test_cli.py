#!/usr/bin/env python3
"""End-to-end tests of the `parallax` binary: help, errors (one line, non-zero exit), config
printing with overrides, and a short training run's outputs. Usage: test_cli.py <parallax>."""
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import unittest

import yaml

PARALLAX = None
SRC = os.environ.get("PARALLAX_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


def run(*args, cwd=None, timeout=300):
    p = subprocess.run([PARALLAX, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def alias_bomb(levels):
    """'Billion laughs': level k lists ten aliases of level k-1 (10^levels scalars in 1 KiB)."""
    lines = ["l0: &l0 [" + ", ".join(["lol"] * 10) + "]"]
    for k in range(1, levels):
        lines.append(f"l{k}: &l{k} [" + ", ".join([f"*l{k - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n"


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
                                  "schedule", "train", "checkpoint", "export", "qat", "lora", "distill"})

    def test_fp8_without_fp8_tensor_cores_is_one_error_line(self):
        # precision.mode=fp8 needs compute capability 8.9 or newer: on the CPU it is refused before
        # anything is built or written; bad recipe keys are refused by the config itself.
        cfg = os.path.join(SRC, "configs", "bev_tiny.yaml")
        with tempfile.TemporaryDirectory() as d:
            rc, _, err = run("train", "--config", cfg, "train.device=cpu", "precision.mode=fp8",
                             f"experiment.output_dir={d}", "model.backbone=vit")
            self.assert_one_error_line(rc, err, "key 'precision.mode': fp8 needs an NVIDIA GPU with FP8 tensor cores",
                                       "cpu", "precision.mode=bf16")
            self.assertEqual(os.listdir(d), [])
        rc, _, err = run("train", "--config", cfg, "precision.fp8.recipe=tensorwise")
        self.assert_one_error_line(rc, err, "precision.fp8.recipe", "tensorwise")
        rc, _, err = run("train", "--config", cfg, "precision.fp8.amax_history=0")
        self.assert_one_error_line(rc, err, "precision.fp8.amax_history")

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

    def test_hostile_yaml_is_one_error_line_in_bounded_time_and_memory(self):
        """Issue 17 item 4: recursive aliases segfaulted (rc 139) and a 10-level alias bomb grew to
        4.9 GB; each is now one error line naming the file, within seconds and a few hundred MB."""
        cases = {
            "self.yaml": ("a: &x [*x]\n", "self.yaml:1:8: recursive alias '*x': it refers to the node that "
                                           "contains it (anchor '&x' at line 1); a config cannot contain itself"),
            "rec.yaml": ("experiment: &e {name: rec, sub: *e}\n", "rec.yaml:1:33: recursive alias '*e'"),
            "laughs.yaml": (alias_bomb(10), "laughs.yaml:5: too large: more than 100000 YAML nodes once aliases "
                                            "are expanded through alias '*l3'"),
        }
        with tempfile.TemporaryDirectory() as d:
            for name, (text, needle) in cases.items():
                path = os.path.join(d, name)
                with open(path, "w") as f:
                    f.write(text)
                start = time.monotonic()
                rc, _, err = run("train", "--config", path, timeout=60)
                self.assertLess(time.monotonic() - start, 30, name)
                # 3: a config error (deterministic; docs/launch.md). A crash is -11, or 139 via a shell.
                self.assertEqual(rc, 3, f"{name}: {err[-500:]!r}")
                self.assert_one_error_line(rc, err, needle)
            # Peak RSS of the largest child so far: the bomb expanded grows past 4 GB.
            max_rss_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            self.assertLess(max_rss_mib, 1024)
            # In an override's value too.
            rc, _, err = run("train", "--config", os.path.join(SRC, "configs", "mlp_demo.yaml"),
                             "model={" + alias_bomb(8).replace("\n", ", ").rstrip(", ") + "}", timeout=60)
            self.assert_one_error_line(rc, err, "too large: more than 100000 YAML nodes")

    def test_duplicate_key_empty_file_and_unknown_restore_are_errors(self):
        cfg = os.path.join(SRC, "configs", "mlp_demo.yaml")
        with tempfile.TemporaryDirectory() as d:
            dup = os.path.join(d, "dup.yaml")
            with open(dup, "w") as f:
                f.write(f"_base_: {cfg}\noptim:\n  lr: 0.1\n  name: sgd\n  lr: 0.2\n")
            rc, _, err = run("train", "--config", dup, "--print-config")
            self.assert_one_error_line(rc, err, f"{dup}:5: duplicate key 'optim.lr' (first set at line 3)")
            empty = os.path.join(d, "empty.yaml")
            open(empty, "w").close()
            rc, _, err = run("train", "--config", empty, "--print-config")
            self.assert_one_error_line(rc, err, f"{empty}: the config is empty")
        rc, _, err = run("train", "--config", cfg, "~optim.lrr", "--print-config")
        self.assert_one_error_line(rc, err, "command-line override '~optim.lrr': unknown key 'optim.lrr' "
                                            "(did you mean 'optim.lr'?)")

    def test_a_megabyte_value_is_cut_in_the_error_line(self):
        cfg = os.path.join(SRC, "configs", "mlp_demo.yaml")
        with tempfile.TemporaryDirectory() as d:
            big = os.path.join(d, "big.yaml")
            with open(big, "w") as f:
                f.write(f"_base_: {cfg}\noptim:\n  name: " + "x" * (1 << 20) + "\n")
            rc, _, err = run("train", "--config", big, "--print-config")
            self.assert_one_error_line(rc, err, f"{big}:3: key 'optim.name' must be one of adamw|sgd, got '"
                                       + "x" * 40 + "...(1048576 bytes)..." + "x" * 40 + "'")
            self.assertLess(len(err), 400)
        # A command-line argument holds at most 128 KiB (Linux MAX_ARG_STRLEN).
        rc, _, err = run("train", "--config", cfg, "optim.name=" + "y" * 100000, "--print-config")
        self.assert_one_error_line(rc, err, "...(100011 bytes)...", "...(100000 bytes)...")
        self.assertLess(len(err), 400)

    def test_config_that_is_a_directory_or_a_symlink_loop_says_so(self):
        with tempfile.TemporaryDirectory() as d:
            rc, _, err = run("train", "--config", d)
            self.assert_one_error_line(rc, err, f"config file '{d}' is a directory, not a YAML file")
            loop = os.path.join(d, "loop.yaml")
            os.symlink(loop, loop)
            rc, _, err = run("train", "--config", loop)
            self.assert_one_error_line(rc, err, f"config file '{loop}' cannot be resolved: symlink loop")
            self.assertNotIn("did you mean", err)

    def test_data_path_that_is_a_file_says_so(self):
        with tempfile.TemporaryDirectory() as d:
            f = os.path.join(d, "shard.h5")
            open(f, "w").close()
            rc, _, err = run("train", "--config", os.path.join(SRC, "configs", "bev_tiny.yaml"), f"data.path={f}",
                             f"experiment.output_dir={d}")
            self.assertEqual(rc, 3, err)  # a data error: deterministic (docs/launch.md)
            # The trainer logs its run directory before it opens the dataset: only the error is checked.
            errors = [l for l in err.splitlines() if l.startswith("parallax: error:")]
            self.assertEqual(errors, [f"parallax: error: '{f}' is a file, not a dataset folder (a folder of HDF5 "
                                      "shards and dataset.json)"])
            # A shard beside a dataset.json: its folder is suggested.
            open(os.path.join(d, "dataset.json"), "w").close()
            rc, _, err = run("train", "--config", os.path.join(SRC, "configs", "bev_tiny.yaml"), f"data.path={f}",
                             f"experiment.output_dir={d}")
            self.assertIn(f"(did you mean its folder '{d}'?)", err)

    def test_unsafe_run_names_are_refused_before_anything_is_written(self):
        """Issue 17 item 5: each of these wrote outside experiment.output_dir or into it directly."""
        cfg = os.path.join(SRC, "configs", "mlp_demo.yaml")
        bad = {"../../escape": "contains '/'", "/tmp/abs": "contains '/'", "a/b": "contains '/'",
               "..": "is '..'", ".": "is '.'", "~": "is empty", "'~x'": "starts with '~'", "": "is empty",
               "'a\tb'": "contains a control character", "'\x01'": "contains a control character"}
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "deep", "runs")
            os.makedirs(out)
            for name, why in bad.items():
                rc, _, err = run("train", "--config", cfg, f"experiment.output_dir={out}", f"experiment.name={name}",
                                 "train.steps=1")
                self.assert_one_error_line(rc, err, "key 'experiment.name' must be one folder name, got '",
                                           f"which {why}")
                if name.isprintable():
                    self.assertIn(f"command-line override 'experiment.name={name}'", err)
            self.assertEqual(os.listdir(out), [])
            self.assertEqual(sorted(os.listdir(d)), ["deep"])
            # An absolute output_dir is fine.
            rc, _, err = run("train", "--config", cfg, f"experiment.output_dir={out}", "experiment.name=ok",
                             "model.size=tiny", "train.steps=1")
            self.assertEqual(rc, 0, err)
            self.assertTrue(os.path.isfile(os.path.join(out, "ok", "config.yaml")))

    def test_numbers_that_would_be_unbounded_are_one_error_line_at_once(self):
        """Issue 35 item 4: each of these started hundreds of workers, ran for minutes, ended in
        std::bad_alloc, or was accepted (or said "-1 must not be negative" for an overflow). Each is
        now one error line naming the flag or key and its bound, within a few seconds, before any
        worker, thread or file exists."""
        mlp = os.path.join(SRC, "configs", "mlp_demo.yaml")
        bev = [os.path.join(SRC, "configs", "bev_tiny.yaml"), "data.synthetic=true"]
        big = "99999999999999999999"
        worker = ["--", "train", "--config", mlp]
        cases = [
            (["launch", "--nproc-per-node", "100000", *worker], ["--nproc-per-node 100000", "1024 workers"]),
            (["launch", "--nproc-per-node", "100000", "--allow-oversubscribe", *worker], ["1024 workers"]),
            (["launch", "--max-restarts", big, *worker], ["--max-restarts", "out of range for a 64-bit integer"]),
            (["launch", "--max-restarts", "100000", *worker], ["--max-restarts must be in 0..1000"]),
            (["launch", "--nnodes", "5000000", "--master", "127.0.0.1:1", *worker], ["--nnodes must be in"]),
            (["launch", "--grace-period", "inf", *worker], ["--grace-period expects a finite number"]),
            (["launch", "--rdzv-timeout", "1e300", *worker], ["--rdzv-timeout must be > 0 and at most 86400"]),
            (["plan", "--config", *bev, "--gpus", "1000000000"], ["--gpus must be in 1..131072"]),
            (["plan", "--config", *bev, "--top", "-1"], ["--top must be in 0.."]),
            (["plan", "--config", *bev, "--inter-node-gbps", "-5"], ["--inter-node-gbps must be > 0"]),
            (["plan", "--config", *bev, "--global-batch", "0"], ["--global-batch must be in 1.."]),
            (["plan", "--config", *bev, "--gpu-mem", "nan"], ["--gpu-mem expects a finite number"]),
            (["plan", "--config", *bev, "--efficiency", "0"], ["--efficiency must be > 0 and at most 1"]),
            (["plan", "--config", *bev, "--bandwidth-mib", "1000000000"], ["--bandwidth-mib must be in 1..4096"]),
            (["plan", "--config", *bev, "--calibrate", "--calibrate-batch", "0"], ["--calibrate-batch must be in"]),
            (["plan", "--config", *bev, "--gpus", "131072", "data.batch_size=65536"],
             ["'data.batch_size'", "8589934592 samples is more than 2147483647"]),
            (["plan", "--config", *bev, "--device", "cpu", "--calibrate", "data.batch_size=65536"],
             ["plan --calibrate: micro-batch 65536", "GiB of activations"]),
            # Config keys that size memory, threads or a step's length.
            (["train", "--config", mlp, "data.batch_size=1000000000", "--print-config"],
             ["key 'data.batch_size'", "must be <= 65536"]),
            (["train", "--config", mlp, "train.grad_accum=1000000000", "--print-config"],
             ["key 'train.grad_accum'", "must be <= 65536"]),
            (["train", "--config", mlp, "data.num_workers=100000", "--print-config"],
             ["key 'data.num_workers'", "must be <= 256"]),
            (["train", "--config", mlp, "data.prefetch=100000", "--print-config"],
             ["key 'data.prefetch'", "must be <= 1024"]),
            (["plan", "--config", *bev, "model.backbone=vit", "lora.rank=100000", "lora.base=base"],
             ["key 'lora.rank': 100000 is more than 96, min(in, out) of the smallest layer",
              "'encoder.vit.block0.attn.qkv' (96 -> 288 features)"]),
            (["export", "--parity-frames", big], ["--parity-frames value '" + big + "' is out of range for a 64-bit"]),
            (["inspect", "--scene-lines", "-1", SRC], ["--scene-lines must be at least 0"]),
            (["datagen", "--out", "OUT", "--scenes", big], ["--scenes value", "out of range for a 64-bit integer"]),
            (["datagen", "--out", "OUT", "--scenes", "100000000"], ["--scenes must be in 1..4194304"]),
            # 2^32 + 128: a cast to int made it 128.
            (["datagen", "--out", "OUT", "--height", "4294967424"], ["--height must be in 8..4096"]),
            (["datagen", "--out", "OUT", "--threads", "100000"], ["--threads must be in 0..1024"]),
            (["datagen", "--out", "OUT", "--bev-range", "5000", "--bev-resolution", "0.01"],
             ["BEV grid of 1000000 x 1000000 cells"]),
            (["datagen", "--out", "OUT", "--threads", "1000", "--cameras", "16", "--height", "4096", "--width",
              "4096"], ["--threads 1000 x 2 scenes in flight", "of memory"]),
            (["train", "--config", mlp, "train.steps=" + big, "--print-config"],
             ["key 'train.steps' value '" + big + "' is out of range for a 64-bit integer"]),
            (["train", "--config", mlp, "data.batch_size=1e12", "--print-config"],
             ["key 'data.batch_size' value '1e12' is out of range for a 32-bit integer"]),
        ]
        with tempfile.TemporaryDirectory() as d:
            for args, needles in cases:
                args = [os.path.join(d, "out") if a == "OUT" else a for a in args]
                start = time.monotonic()
                rc, _, err = run(*args, cwd=d, timeout=60)
                took = time.monotonic() - start
                self.assert_one_error_line(rc, err, *needles)
                self.assertLess(took, 10, args)  # ~0.5 s each; slack for a loaded 2-core machine
            self.assertEqual(os.listdir(d), [], "nothing written: no logs, dataset or run folder")

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
                if r["kind"] == "memory":  # after step 1: each rank's engine bytes (docs/training.md)
                    self.assertEqual(r["step"], 1)
                    self.assertGreater(r["params_r0"], 0)
                    continue
                for k in ("loss", "lr", "step_ms", "img_per_s"):
                    self.assertIn(k, r)


if __name__ == "__main__":
    PARALLAX = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
