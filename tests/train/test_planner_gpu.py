#!/usr/bin/env python3
"""`parallax plan` against real runs on one GPU (issue 23): the planner's prediction for the
configured layout of W1 (ViT-B/16, batch 128, bf16) and W2 (bev base, batch 32, bf16), calibrated
on this GPU with `--calibrate`, against the same config trained for 25 steps:

- peak memory (the allocator's peak, `mem_gb`, against the plan's allocated bytes) within 10%;
- step time (the median `step_ms` after the first two steps) within 20%;
- the same for W1 under precision.mode=fp8 (issue 39) on a GPU with FP8 tensor cores.

These are the issue's bounds; the test fails when the model drifts beyond them. W2 needs about
73 GiB, so it runs only where the GPU has 78 GiB or more. Exits 77 (ctest: skipped) without a GPU.

Usage: test_planner_gpu.py <parallax binary> <mpirun>
"""
import json
import os
import statistics
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train as tt  # noqa: E402  (shared helpers: run, metrics, RunDirTest)

BENCH = os.path.join(tt.SRC, "configs", "bench")


def gpu_memory_gib():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60).stdout
        return [int(x) / 1024 for x in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


class PlannerGpuTest(tt.RunDirTest):
    def check(self, workload, calibrate_batch, *overrides, name=None):
        config = os.path.join(BENCH, f"{workload}.yaml")
        name = name or workload
        tt.run(["train", "--config", config, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                "train.steps=25", "train.log_every=1", *overrides])
        rows = tt.metrics(os.path.join(self.d, name))
        step_ms = statistics.median(r["step_ms"] for r in rows if r["step"] > 2)
        mem_gib = max(r.get("mem_gb", 0) for r in rows)  # the allocator's peak, GiB
        plan_json = os.path.join(self.d, f"{name}.plan.json")
        tt.run(["plan", "--config", config, "--device", "h100", "--only-config", "--calibrate",
                "--calibrate-batch", str(calibrate_batch), "--json", plan_json, *overrides])
        with open(plan_json) as f:
            plan = json.load(f)
        [layout] = [x for x in plan["layouts"] if x["configured"]]
        mem_pred = layout["peak"]["allocated"] / 2**30
        step_pred = layout["time"]["step_ms"]
        print(f"{name}: peak memory predicted {mem_pred:.2f} / measured {mem_gib:.2f} GiB "
              f"({mem_pred / mem_gib:.3f}); step predicted {step_pred:.1f} / measured {step_ms:.1f} ms "
              f"({step_pred / step_ms:.3f}); {plan['hardware']['source']}", file=sys.stderr)
        self.assertLessEqual(abs(mem_pred / mem_gib - 1), 0.10, f"{name} peak memory")
        self.assertLessEqual(abs(step_pred / step_ms - 1), 0.20, f"{name} step time")

    def test_w1_vit_b16(self):
        self.check("w1_vit_b16", 32)

    def test_w1_vit_b16_fp8(self):
        # precision.mode=fp8 (issue 39): the blocks' linear layers save FP8 inputs and cast their
        # weights to FP8 themselves, 1.1 GB less than bf16 at this batch (docs/PERFORMANCE.md); the
        # planner's bf16 model would over-predict by about 15%.
        if not tt.fp8_gpu():
            self.skipTest("needs a GPU with FP8 tensor cores")
        self.check("w1_vit_b16", 32, "precision.mode=fp8", name="w1_vit_b16_fp8")

    def test_w2_bev_base(self):
        if min(gpu_memory_gib()) < 78:
            self.skipTest("W2 needs a GPU of 78 GiB or more")
        self.check("w2_bev_base", 8)


if __name__ == "__main__":
    tt.PARALLAX, tt.MPIRUN = os.path.abspath(sys.argv[1]), sys.argv[2]
    if not gpu_memory_gib():
        print("no GPU: skipped")
        sys.exit(77)
    unittest.main(argv=sys.argv[:1] + sys.argv[3:], verbosity=2)
