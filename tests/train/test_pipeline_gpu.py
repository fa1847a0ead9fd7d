#!/usr/bin/env python3
"""Pipeline parallelism on two GPUs (issue 19; NCCL point-to-point between the stages, each rank on
its own GPU): `mpirun -np 2 parallax train ... parallel.pp=2 train.device=cuda` against one GPU with
the same global batch and micro-batches:

- vit_cls (fp32) under 1f1b and zb: per-step losses within RTOL;
- the BEV model with the ViT backbone (bf16 autocast, the side inputs on the second stage) under
  1f1b: within the bf16 bound of tests/train/test_pipeline.py;
- on four GPUs (skipped with fewer): vit_cls pp 4 and dp 2 x pp 2 within RTOL.

Exits 77 (ctest: skipped) on a node with fewer than two GPUs.

Usage: test_pipeline_gpu.py <parallax binary> <mpirun>
"""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
        for sched in ["1f1b", "zb"]:
            with self.subTest(sched):
                tt.run(self.common(sched, *vit, "parallel.pp=2", f"parallel.pp_schedule={sched}"), 2)
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


if __name__ == "__main__":
    tt.PARALLAX, tt.MPIRUN = sys.argv[1], sys.argv[2]
    if gpu_count() < 2:
        print("test_pipeline_gpu: fewer than two GPUs, skipped")
        sys.exit(77)
    unittest.main(argv=sys.argv[:1], verbosity=2)
