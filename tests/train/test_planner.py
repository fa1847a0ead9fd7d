#!/usr/bin/env python3
"""`parallax plan` against real runs (issue 23):

- for every layout the CPU tests train (one process, dp DDP, ZeRO-1/2/3, tp, pp, dp x pp, dp x tp,
  dp 2 x tp 2 x pp 2 on 8 ranks, and LoRA under DDP and ZeRO-3), the planner's parameter, gradient
  and optimizer bytes of
  every rank equal what that rank's engine reports after the first step (the trainer's "memory"
  metrics row, Engine::memory()) exactly;
- the CLI ranks layouts, marks the config's own, writes JSON, and names why a layout cannot run;
- bad input is one `parallax: error:` line.

The activation model is held to 15% of a real forward in planner_tests (C++).

CI time (2 cores): what each run costs beyond what the assertions read.
- The trainer's plots (tools/plot_metrics.py, ~1 s of CPU per run) are not drawn: no test here
  reads them (test_train.py does). PARALLAX_PYTHON, the interpreter the trainer runs them with, is
  a script that skips that tool for this file's runs (tt.SkippedPlots).
- --calibrate trains 50 steps or more (a warm-up, 20 at the batch, 20 at each doubling); on vit_cls
  tiny (~10 ms a step here) rather than bev tiny's ViT (~0.25 s): what the test reads is that it
  measures (an efficiency in (0, 1], a bandwidth), not the model's figures.
- The one-process layout is trained once (it was trained again to compare ZeRO-3 with it).
- Each layout's `parallax plan` runs beside its training run (the plan reads no run directory).

Usage: test_planner.py <parallax binary> <mpirun>
"""
import concurrent.futures
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train as tt  # noqa: E402  (shared helpers: run, metrics)


def run_bounded(args, timeout=120, limit_gib=6):
    """`parallax <args>` under a `limit_gib` address-space limit (a plan that allocates by the batch
    fails fast instead of swapping a shared machine). Returns (exit code, stdout, stderr, seconds,
    peak RSS in MiB)."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (limit_gib << 30, limit_gib << 30))

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        p = subprocess.Popen([tt.PARALLAX, *args], stdout=out, stderr=err, preexec_fn=limit)
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > timeout:
                p.kill()
                _, status, usage = os.wait4(p.pid, 0)
                break
            time.sleep(0.05)
        took = time.monotonic() - start
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read().decode(), err.read().decode(), took, usage.ru_maxrss / 1024


PLOTS = tt.SkippedPlots()  # no plots (above)


def setUpModule():
    PLOTS.start()


def tearDownModule():
    PLOTS.stop()


class PlannerTest(tt.RunDirTest):
    COMMON = ["train.device=cpu", "train.benchmark=true", "train.steps=1", "train.log_every=1",
              "model.backbone=vit", "data.batch_size=1"]

    def check_layout(self, name, ranks, *extra):
        """Trains one step of `extra` on `ranks` CPU ranks and compares every rank's engine memory
        with the planner's prediction for the same config."""
        args = ["--config", tt.BEV, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                *self.COMMON, *extra]
        out = os.path.join(self.d, f"{name}.json")
        # The plan (which reads no run directory) beside the training run.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            plan = pool.submit(tt.run, ["plan", *args, "--device", "cpu", "--gpus", str(ranks), "--only-config",
                                        "--json", out])
            tt.run(["train", *args], ranks)
            plan.result()
        rows = tt.metrics(os.path.join(self.d, name), kind="memory")
        self.assertEqual(len(rows), 1, name)
        measured = rows[0]
        with open(out) as f:
            doc = json.load(f)
        predicted = doc["engine_memory"]
        self.assertEqual(len(predicted), ranks)
        for r, p in enumerate(predicted):
            for key in ("params", "grads", "optimizer"):
                self.assertEqual(p[key], measured[f"{key}_r{r}"], f"{name}: rank {r} {key}")
        # The table's row for the same layout reports one of those ranks (the one with the most
        # memory in all).
        row = doc["layouts"][0]
        self.assertTrue(row["configured"])
        peak = (row["peak"]["params"], row["peak"]["grads"], row["peak"]["optimizer"])
        self.assertIn(peak, [(p["params"], p["grads"], p["optimizer"]) for p in predicted])
        return predicted

    def test_one_process_and_data_parallel(self):
        one = self.check_layout("one", 1)
        self.check_layout("ddp", 2)
        self.check_layout("z1", 2, "parallel.zero.stage=1")
        # Stage 2 with several micro-steps keeps a shard accumulator.
        self.check_layout("z2", 2, "parallel.zero.stage=2", "train.grad_accum=2")
        z3 = self.check_layout("z3", 2, "parallel.zero.stage=3")
        # ZeRO-3's shards: each rank holds about half the parameters of one process.
        self.assertLess(z3[0]["params"], one[0]["params"] * 0.6)

    def test_tensor_and_pipeline_parallel(self):
        self.check_layout("tp2", 2, "parallel.tp=2")
        self.check_layout("pp2", 2, "parallel.pp=2", "train.grad_accum=2")
        self.check_layout("dp2pp2", 4, "parallel.pp=2", "parallel.zero.stage=1", "train.grad_accum=2")
        self.check_layout("dp2tp2", 4, "parallel.tp=2", "parallel.zero.stage=2",
                          "parallel.sequence_parallel=true")

    def test_lora(self):
        # A frozen base and trainable adapters: the base is whole under DDP and ZeRO-1, sharded
        # per unit under ZeRO-3; only the adapters have gradients and optimizer state.
        tt.run(["train", "--config", tt.BEV, f"experiment.output_dir={self.d}", "experiment.name=base",
                *self.COMMON, "train.benchmark=false", "data.synthetic=true"])  # with a checkpoint
        lora = ["lora.rank=2", f"lora.base={os.path.join(self.d, 'base')}"]
        one = self.check_layout("lora1", 1, *lora)
        self.assertLess(one[0]["grads"], one[0]["params"] / 10)
        self.check_layout("lora_ddp", 2, *lora)
        self.check_layout("lora_z3", 2, *lora, "parallel.zero.stage=3")

    def test_3d(self):
        self.check_layout("3d", 8, "parallel.tp=2", "parallel.pp=2", "parallel.zero.stage=1",
                          "train.grad_accum=2")

    def test_cli_ranks_and_rejects(self):
        out = os.path.join(self.d, "plan.json")
        p = tt.run(["plan", "--config", tt.BEV, "--gpus", "8", "--gpu-mem", "80", "--json", out,
                    *self.COMMON])
        self.assertIn("<- the config's layout", p.stdout)
        self.assertIn("rejected:", p.stdout)
        with open(out) as f:
            rows = json.load(f)["layouts"]
        fits = [r for r in rows if r["fits"]]
        self.assertTrue(fits)
        speeds = [r["time"]["samples_per_s"] for r in fits]
        self.assertEqual(speeds, sorted(speeds, reverse=True))
        reasons = " ".join(r["reason"] for r in rows if not r["fits"])
        self.assertIn("attention heads", reasons)  # tp 8 does not divide bev tiny's 4 heads
        self.assertIn("ZeRO-3", reasons)           # refused under pp
        for r in fits:
            self.assertEqual(r["dp"] * r["tp"] * r["pp"], 8)
            self.assertGreater(r["peak"]["total"], r["peak"]["params"])
        # --calibrate runs the trainer (one process) and measures the efficiency and host floor, then
        # the all-reduce bandwidth in a node over 2 CPU ranks started through the launcher (gloo).
        # On vit_cls tiny: its 50+ training steps take ~0.5 s (bev tiny's ViT: ~12 s).
        out = os.path.join(self.d, "calibrated.json")
        p = tt.run(["plan", "--config", tt.MLP, "--device", "cpu", "--gpus", "2", "--calibrate",
                    "--calibrate-batch", "1", "--bandwidth-mib", "4", "--only-config", "--json", out,
                    "model.name=vit_cls", "model.size=tiny", "model.num_classes=10", "train.device=cpu",
                    "train.benchmark=true", "data.batch_size=1"])
        self.assertIn("calibrated on this machine (cpu)", p.stdout)
        self.assertIn("all-reduce bus bandwidth", p.stdout)
        with open(out) as f:
            hw = json.load(f)["hardware"]
        self.assertGreater(hw["efficiency"], 0)
        self.assertLessEqual(hw["efficiency"], 1)
        self.assertGreater(hw["intra_node_gbps"], 0)
        self.assertIn(f"all-reduce bus bandwidth {hw['intra_node_gbps']:.2f} GB/s over 2 local ranks", hw["source"])
        # Bad input: one error line.
        for extra, needle in [(["--gpus", "3", "--nodes", "2"], "--gpus 3"),
                              (["--device", "tpu"], "--device 'tpu'"),
                              (["model.size=huge"], "model.size")]:
            p = tt.run(["plan", "--config", tt.BEV, *extra, *self.COMMON], check=False)
            self.assertNotEqual(p.returncode, 0, extra)
            errors = [line for line in p.stderr.splitlines() if line.startswith("parallax: error:")]
            self.assertEqual(len(errors), 1, p.stderr[-2000:])
            self.assertIn(needle, errors[0])

    def test_the_search_is_arithmetic_in_the_batch_and_scales_with_divisors(self):
        """Issue 35 item 4. A billion-sample batch is arithmetic (the pipeline layouts' schedules,
        built op by op, are bounded and rejected with the reason), and a GPU count with many
        divisors gives one row per impossible (dp, tp, pp) rather than ~10^3: before, --gpus 110880
        took 2 GB and 11 s, and data.batch_size=10^8 on 8 GPUs built schedules of 10^8 micro-batches."""
        bev = ["--config", tt.BEV, "data.synthetic=true"]
        out = os.path.join(self.d, "big_batch.json")
        # data.batch_size is capped at 65536 per rank (data/data_config.h); --global-batch is not.
        rc, stdout, err, took, rss = run_bounded(["plan", *bev, "--gpus", "8", "--global-batch", "800000000",
                                                  "--json", out])
        self.assertEqual(rc, 0, err[-2000:])
        self.assertLess(took, 60)
        self.assertLess(rss, 1024)
        with open(out) as f:
            rows = json.load(f)["layouts"]
        self.assertTrue(any(r["fits"] for r in rows))
        pipeline = [r for r in rows if r["pp"] > 1]
        self.assertTrue(pipeline)
        beyond = [r for r in pipeline if r["micro_batches"] * r["pp"] * r["virtual_stages"] > 65536]
        self.assertTrue(beyond and not any(r["fits"] for r in beyond))
        self.assertIn("more than the 65536 a pipeline schedule is built and simulated for",
                      " ".join(r["reason"] for r in beyond))
        big = [r for r in rows if r["micro_batch"] == 100000000]
        self.assertTrue(big and all(not r["fits"] and "GiB" in r["reason"] for r in big))

        out = os.path.join(self.d, "many_gpus.json")
        rc, stdout, err, took, rss = run_bounded(["plan", *bev, "--gpus", "110880", "--json", out])
        self.assertEqual(rc, 0, err[-2000:])
        self.assertLess(rss, 1024)
        with open(out) as f:
            rows = json.load(f)["layouts"]
        self.assertTrue(any(r["fits"] for r in rows))
        # 110880 has 120 divisors: 3402 (tp, pp) pairs, one row each for those that cannot run.
        self.assertLess(len(rows), 20000)
        reasons = " ".join(r["reason"] for r in rows)
        self.assertTrue("units to spread over them" in reasons)  # pp > units: one row per (tp, pp)
        self.assertTrue("TP splits ViT blocks only" in reasons)  # bev_tiny's conv backbone at tp > 1

        # --top 0: every layout that fits.
        out = os.path.join(self.d, "top0.json")
        p = tt.run(["plan", *bev, "--gpus", "8", "--top", "0", "--json", out])
        with open(out) as f:
            fits = sum(1 for r in json.load(f)["layouts"] if r["fits"])
        self.assertGreater(fits, 15)
        table = p.stdout.split("rejected:")[0]
        self.assertEqual(len(re.findall(r"^ *\d+ \d+ \d+ \d+ z\d ", table, re.M)), fits)


if __name__ == "__main__":
    tt.PARALLAX, tt.MPIRUN = sys.argv[1], sys.argv[2]
    unittest.main(argv=sys.argv[:1], verbosity=2)
