#!/usr/bin/env python3
"""Pipeline parallelism on two GPUs (issue 19; NCCL point-to-point between the stages, each rank on
its own GPU): `mpirun -np 2 parallax train ... parallel.pp=2 train.device=cuda` against one GPU with
the same global batch and micro-batches:

- vit_cls (fp32) under every schedule (gpipe, 1f1b, interleaved with 2 virtual stages, zb):
  per-step losses within RTOL;
- the BEV model with the ViT backbone (bf16 autocast, the side inputs on the second stage) under
  1f1b: within the bf16 bound of tests/train/test_pipeline.py;
- issue 36: bev/large (configs/bench/w2_bev_base.yaml, model.size=large) pp 2 trains under every
  schedule with micro-batches of 8 samples (x 4, the command that hung on NCCL: each stage
  boundary's message is then tens of MB, beyond what NCCL buffers, so 1f1b's opposite sends
  deadlocked unless posted as one group) and of 2 samples (x 8), finite losses, two steps each;
- issue 36: a pipeline stage stopped (SIGSTOP) under NCCL: the survivor's point-to-point wait
  times out within parallel.timeout_s, with one error line naming the stage, the micro-batch, the
  peer and the bytes, and the job ends (test_stopped_rank.py's check, on GPUs);
- on four GPUs (skipped with fewer): vit_cls pp 4 and dp 2 x pp 2 within RTOL.

Exits 77 (ctest: skipped) on a node with fewer than two GPUs.

Usage: test_pipeline_gpu.py <parallax binary> <mpirun>
"""
import math
import os
import re
import signal
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_stopped_rank as sr  # noqa: E402  (the stopped-rank check)
import test_train as tt  # noqa: E402  (shared helpers: run, metrics, RunDirTest)

# fp32 (TF32 off: LibTorch's default, which the trainer keeps): each stage runs the same kernels
# on the same shapes as the single process, so the losses differ only through the global gradient
# norm for clipping, whose per-stage partial sums are added over the pp group (another summation
# order, ~1e-7 relative) -- the margin of tests/train/test_pipeline.py. The runs use SGD with
# momentum (tests/TOLERANCES.md, "Equivalence tests": AdamW trajectories are not compared, as
# AdamW's normalised update turns a rounding difference in a near-zero gradient into a full step).
RTOL = 1e-4
# bf16 autocast: 8 significant bits per activation (test_pipeline.py's bound).
RTOL_BF16 = 2e-2


gpu_count = tt.gpu_count


losses = tt.losses


class PipelineGpuTest(tt.RunDirTest):
    COMMON = ["train.log_every=1", "train.device=cuda", "schedule.name=constant", "schedule.warmup_steps=2",
              "optim.grad_clip=1.0", "train.grad_accum=4", "train.steps=3"]

    def assert_close(self, got, want, rtol, label):
        self.assertEqual(sorted(got), sorted(want), label)
        worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
        print(f"{label}: max loss rel diff {worst:.3g}", file=sys.stderr)
        for s in want:
            self.assertAlmostEqual(got[s], want[s], delta=rtol * abs(want[s]), msg=f"{label} step {s}")

    def test_vit_pipeline_on_two_gpus_matches_one_gpu(self):
        vit = ["model.name=vit_cls", "model.size=tiny", "model.num_classes=8", "data.batch_size=4", *tt.sgd(0.03)]
        tt.run(self.common("one", *vit))
        want = losses(os.path.join(self.d, "one"))
        for sched in ["1f1b", "zb", "gpipe", "interleaved"]:
            with self.subTest(sched):
                extra = ["parallel.pp_virtual_stages=2"] if sched == "interleaved" else []
                tt.run(self.common(sched, *vit, "parallel.pp=2", f"parallel.pp_schedule={sched}", *extra), 2)
                self.assert_close(losses(os.path.join(self.d, sched)), want, RTOL, f"vit pp2 {sched}")

    def test_vit_pipeline_on_four_gpus_matches_one_gpu(self):
        # pp 4 (vit_cls tiny: 4 units, one per stage) and dp 2 x pp 2 (2 samples per dp rank, the
        # gradients all-reduced over NCCL between the stage replicas; ZeRO-2 as in test_pipeline.py).
        if gpu_count() < 4:
            self.skipTest("needs four GPUs")
        vit = ["model.name=vit_cls", "model.size=tiny", "model.num_classes=8", *tt.sgd(0.03)]
        tt.run(self.common("one", *vit, "data.batch_size=4"))
        want = losses(os.path.join(self.d, "one"))
        for name, extra in [("pp4", ["parallel.pp=4", "data.batch_size=4"]),
                            ("dp2pp2", ["parallel.pp=2", "parallel.dp=2", "parallel.zero.stage=2",
                                        "data.batch_size=2"])]:
            with self.subTest(name):
                tt.run(self.common(name, *vit, *extra), 4)
                self.assert_close(losses(os.path.join(self.d, name)), want, RTOL, f"vit {name}")

    def test_bev_bf16_pipeline_on_two_gpus_matches_one_gpu(self):
        bev = ["train", "--config", tt.BEV, f"experiment.output_dir={self.d}", "model.backbone=vit",
               "data.synthetic=true", "data.batch_size=1", "precision.mode=bf16", *self.COMMON, *tt.sgd(0.01)]
        tt.run([*bev, "experiment.name=one"])
        tt.run([*bev, "experiment.name=pp", "parallel.pp=2"], 2)
        self.assert_close(losses(os.path.join(self.d, "pp")), losses(os.path.join(self.d, "one")), RTOL_BF16,
                          "bev bf16 pp2 1f1b")

    def test_bev_large_pipeline_trains_under_every_schedule_at_large_messages(self):
        w2 = os.path.join(sr.SRC, "configs", "bench", "w2_bev_base.yaml")
        for sched in ["1f1b", "zb", "gpipe", "interleaved"]:
            for batch, micro in [(8, 4), (2, 8)]:
                name = f"bevl_{sched}_b{batch}x{micro}"
                with self.subTest(name):
                    extra = ["parallel.pp_virtual_stages=2"] if sched == "interleaved" else []
                    tt.run(["train", "--config", w2, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                            "model.size=large", f"data.batch_size={batch}", f"train.grad_accum={micro}",
                            "parallel.pp=2", f"parallel.pp_schedule={sched}", "parallel.timeout_s=60",
                            "train.steps=2", "train.log_every=1", *extra], 2, timeout=300)
                    got = losses(os.path.join(self.d, name))
                    self.assertEqual(sorted(got), [1, 2], name)
                    self.assertTrue(all(math.isfinite(v) for v in got.values()), got)


class PipelineStoppedStageOnNcclTest(sr.StoppedRankTest):
    """test_stopped_rank.py's pipeline check with the ranks on GPUs and NCCL between the stages."""

    def test_mpirun_stopped_pipeline_stage_on_nccl(self):
        for victim in (0, 1):
            with self.subTest(victim=victim):
                name, line = self.check("mpirun", victim, signal.SIGSTOP, extra=(*self.PIPELINE, "train.device=cuda"),
                                        backend="nccl", op=r"recv from rank|send to rank|all_reduce|broadcast|all_gather")
                self.assertIn("timed out", line)
                # The watchdog's failure itself, not "aborted by an earlier failure" (comm_base.cpp:
                # the first caller after the watchdog's abort is told the cause).
                self.assertNotIn("aborted by an earlier failure", line)
                if re.search(r"recv from rank|send to rank", line):
                    self.assertRegex(line, r"\(\d+(\.\d)? [KMG]?i?B\)", line)
                    self.assertRegex(line, r"pipeline stage \d \(pipeline rank \d\) (receiving|sending) the "
                                           r"(activations|gradients) of micro-batch \d", line)


if __name__ == "__main__":
    tt.PARALLAX, tt.MPIRUN = sys.argv[1], sys.argv[2]
    sr.PARALLAX, sr.MPIRUN = os.path.abspath(sys.argv[1]), sys.argv[2]
    if gpu_count() < 2:
        print("test_pipeline_gpu: fewer than two GPUs, skipped")
        sys.exit(77)
    # Only this file's tests (PipelineStoppedStageOnNcclTest inherits the CPU stopped-rank tests).
    load = unittest.defaultTestLoader
    tests = [*load.loadTestsFromTestCase(PipelineGpuTest),
             PipelineStoppedStageOnNcclTest("test_mpirun_stopped_pipeline_stage_on_nccl")]
    only = sys.argv[3:]  # optional test-name filters (substrings)
    suite = unittest.TestSuite(t for t in tests if not only or any(o in t.id() for o in only))
    sys.exit(0 if unittest.TextTestRunner(verbosity=2).run(suite).wasSuccessful() else 1)
