#!/usr/bin/env python3
"""Whole-step CUDA graph capture (train.cuda_graph) against the eager trainer, on real GPUs:

- one GPU: the mlp stand-in (fp32, a warm-up schedule so the learning rate changes every step,
  gradient clipping, two micro-steps) and ViT-B/16 (bf16 autocast, fused AdamW) give the eager
  run's per-step losses and final weights;
- two GPUs (mpirun, NCCL DDP with grouped and flat buckets): the same, with the bucket
  all-reduces captured into the graph;
- a run resumed from a graph run's checkpoint continues it;
- a rank that stops after the capture makes the other rank fail with a TimeoutError naming the
  step instead of hanging;
- what a graph cannot do (fp16 loss scaling, the BEV model's data-dependent shapes) is refused
  naming the key.

Exits 77 (ctest: skipped) without a GPU, or without two for the two-rank cases.

Usage: test_cuda_graph.py <parallax binary> <mpirun> [CudaGraphTest.test_name ...]
"""
import os
import signal
import subprocess
import sys
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train as tt  # noqa: E402  (shared helpers: run, metrics, weights, RunDirTest)

GPUS = 0
SRC = tt.SRC
MLP = tt.MLP
BEV = tt.BEV
W1 = os.path.join(SRC, "configs", "bench", "w1_vit_b16.yaml")


gpu_count = tt.gpu_count


losses = tt.losses


class CudaGraphTest(tt.RunDirTest):
    MLP_COMMON = ["model.size=tiny", "train.device=cuda", "train.log_every=1", "schedule.warmup_steps=6",
                  "optim.grad_clip=0.5", "train.grad_accum=2", "train.cuda_graph_warmup=2"]

    def train(self, config, name, *extra, ranks=1, check=True, timeout=600):
        return tt.run(["train", "--config", config, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                    *extra], ranks, timeout, check)

    def assert_same_run(self, eager, graph, loss_rtol, weight_atol, label):
        """Per-step losses and final weights of two runs agree; prints how closely."""
        a, b = losses(os.path.join(self.d, eager)), losses(os.path.join(self.d, graph))
        self.assertEqual(sorted(a), sorted(b), label)
        loss_diff = max(abs(a[s] - b[s]) / max(abs(a[s]), 1e-12) for s in a)
        wa, wb = tt.weights(os.path.join(self.d, eager)), tt.weights(os.path.join(self.d, graph))
        self.assertEqual(sorted(wa), sorted(wb), label)
        w_diff = max(float(np.max(np.abs(wa[k].astype(np.float64) - wb[k].astype(np.float64)))) for k in wa)
        bitwise = all(a[s] == b[s] for s in a) and all(np.array_equal(wa[k], wb[k]) for k in wa)
        print(f"{label}: max loss rel diff {loss_diff:.3g}, max weight abs diff {w_diff:.3g}, bitwise {bitwise}",
              file=sys.stderr)
        self.assertLessEqual(loss_diff, loss_rtol, label)
        self.assertLessEqual(w_diff, weight_atol, label)
        return a

    def test_one_gpu_mlp_matches_eager(self):
        self.train(MLP, "eager", *self.MLP_COMMON, "train.steps=10")
        p = self.train(MLP, "graph", *self.MLP_COMMON, "train.steps=10", "train.cuda_graph=true")
        self.assertIn("CUDA graph: step 3 captured", p.stderr)
        # Same kernels in the same order, and the fused AdamW kernel computes in fp32 whether the
        # learning rate comes as an argument or as the fp32 tensor: bitwise (2 x H200, 2026-11-23).
        a = self.assert_same_run("eager", "graph", 0, 0, "mlp 1 GPU")
        self.assertLess(a[10], a[1])  # it trained

    def test_one_gpu_vit_bf16_matches_eager(self):
        common = ["data.batch_size=16", "train.steps=8", "train.log_every=1", "train.benchmark=false",
                  "schedule.name=cosine", "schedule.warmup_steps=3"]
        self.train(W1, "vit_eager", *common)
        self.train(W1, "vit_graph", *common, "train.cuda_graph=true")
        # Bitwise on H200 (2026-11-23); the tolerance allows for an attention backward that
        # accumulates in a different order run to run on other GPUs or library versions.
        self.assert_same_run("vit_eager", "vit_graph", 1e-4, 1e-4, "ViT-B/16 bf16 1 GPU")

    def test_one_gpu_vit_param_groups_match_eager(self):
        # Layer decay (13 distinct rates over ViT-B/16's 14 layer ids), a frozen stem and a decay
        # multiplier: the captured step keeps one device lr tensor per distinct multiplier, written
        # each step by set_lr, and the fused AdamW kernel reads it as the fp32 of lr x mult, the
        # rate the eager step passes as a scalar.
        common = ["data.batch_size=16", "train.steps=8", "train.log_every=1", "train.benchmark=false",
                  "schedule.name=cosine", "schedule.warmup_steps=3", "optim.layer_decay=0.75",
                  "optim.param_groups=[{match: 'vit.patch_embed.*', frozen: true},"
                  " {match: 'head.*', lr_mult: 2.0, weight_decay_mult: 0.0}]"]
        p = self.train(W1, "pg_eager", *common)
        self.assertIn("optim.layer_decay=0.75", p.stderr)
        self.train(W1, "pg_graph", *common, "train.cuda_graph=true")
        self.assert_same_run("pg_eager", "pg_graph", 1e-4, 1e-4, "ViT-B/16 bf16 param groups 1 GPU")

    def test_one_gpu_vit_fp8_matches_eager(self):
        if not tt.fp8_gpu():
            self.skipTest("needs a GPU with FP8 tensor cores (compute capability >= 8.9)")
        common = ["data.batch_size=16", "train.steps=8", "train.log_every=1", "train.benchmark=false",
                  "precision.mode=fp8"]
        for recipe in ("current", "delayed"):
            self.train(W1, f"fp8_{recipe}_eager", *common, f"precision.fp8.recipe={recipe}")
            p = self.train(W1, f"fp8_{recipe}_graph", *common, f"precision.fp8.recipe={recipe}",
                           "train.cuda_graph=true")
            self.assertIn("CUDA graph: step 4 captured", p.stderr)
            # The delayed recipe's scales come from the amax history, rolled inside the captured
            # step: replays must read the history each step writes (a stale copy of the scales
            # changes every FP8 rounding from the first replay on). Bitwise on H200 (2026-11-30:
            # the casts' amaxes are maxima, the bias gradients' column sums have a fixed order).
            self.assert_same_run(f"fp8_{recipe}_eager", f"fp8_{recipe}_graph", 1e-4, 1e-4,
                                 f"ViT-B/16 fp8 {recipe} 1 GPU")

    def test_two_gpus_ddp_matches_eager_grouped_and_flat(self):
        if GPUS < 2:
            self.skipTest("needs 2 GPUs")
        self.train(MLP, "dp_eager", *self.MLP_COMMON, "train.steps=10", ranks=2)
        for mode in ("grouped", "flat"):
            p = self.train(MLP, f"dp_graph_{mode}", *self.MLP_COMMON, "train.steps=10", "train.cuda_graph=true",
                           f"parallel.ddp.bucket_mode={mode}", ranks=2)
            self.assertIn(f"{mode} buckets", p.stderr)
            self.assert_same_run("dp_eager", f"dp_graph_{mode}", 0, 0, f"mlp 2 GPUs DDP {mode}")

    def test_resume_from_a_graph_checkpoint(self):
        common = [*self.MLP_COMMON, "train.steps=10", "train.cuda_graph=true"]
        self.train(MLP, "full", *common, "checkpoint.every=5")
        step5 = os.path.join(self.d, "full", "checkpoints", "step_00000005")
        self.assertTrue(os.path.isdir(step5))
        self.train(MLP, "resumed", *common, f"train.resume={step5}")
        a, b = losses(os.path.join(self.d, "full")), losses(os.path.join(self.d, "resumed"))
        self.assertEqual(sorted(b), [6, 7, 8, 9, 10])
        for s in b:
            self.assertEqual(a[s], b[s], f"step {s}")
        # The optimizer's step count (AdamW's bias correction) was saved and restored.
        wa, wb = tt.weights(os.path.join(self.d, "full")), tt.weights(os.path.join(self.d, "resumed"))
        for k in wa:
            self.assertTrue(np.array_equal(wa[k], wb[k]), k)

    def test_a_stopped_rank_is_a_timeout_naming_the_step(self):
        if GPUS < 2:
            self.skipTest("needs 2 GPUs")
        # No log steps after the capture: the eager collectives' own watchdog must not be what fires.
        args = [tt.MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", "2", tt.PARALLAX, "train", "--config", MLP,
                f"experiment.output_dir={self.d}", "experiment.name=stall", *self.MLP_COMMON, "train.steps=100000",
                "train.log_every=100000", "train.cuda_graph=true", "parallel.timeout_s=5",
                # The per-step buffer broadcast is an eager collective with its own timeout.
                "parallel.ddp.broadcast_buffers=false"]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stalled = None
        try:
            time.sleep(1)
            deadline = time.time() + 120
            while stalled is None and time.time() < deadline and proc.poll() is None:
                stalled = self.rank_pid(1, "stall")
                time.sleep(0.5)
            if stalled is None:
                return self.fail(f"rank 1 not found:\n{proc.communicate(timeout=60)[1][-3000:]}")
            time.sleep(15)  # well past the capture (step 3)
            self.assertIsNone(proc.poll(), "the run ended before rank 1 could be stopped")
            os.kill(stalled, signal.SIGSTOP)
            start = time.time()
            _, err = proc.communicate(timeout=120)
            elapsed = time.time() - start
        finally:
            if proc.poll() is None:
                proc.kill()
            if stalled is not None:
                try:
                    os.kill(stalled, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("CUDA graph: step 3 captured", err)
        self.assertRegex(err, r"rank 0: training step \d+ \(one CUDA graph replay")
        self.assertIn("did not finish within 5 s", err)
        self.assertLess(elapsed, 90)

    @staticmethod
    def rank_pid(rank, name):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
                if not cmd or os.path.basename(cmd[0]) != b"parallax" or f"experiment.name={name}".encode() not in cmd:
                    continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
                if env.get(b"OMPI_COMM_WORLD_RANK") == str(rank).encode():
                    return int(pid)
            except OSError:
                continue
        return None

    def test_what_a_graph_cannot_do_is_refused(self):
        p = self.train(MLP, "fp16", *self.MLP_COMMON, "train.steps=2", "precision.mode=fp16", "train.cuda_graph=true",
                       check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("key 'train.cuda_graph': precision.mode=fp16", p.stderr)
        p = self.train(BEV, "bev", "train.device=cuda", "data.synthetic=true", "train.steps=2",
                       "train.cuda_graph=true", check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("model 'bev' cannot be captured", p.stderr)
        p = self.train(MLP, "unfused", *self.MLP_COMMON, "train.steps=2", "optim.fused=off", "train.cuda_graph=true",
                       check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("key 'optim.fused'", p.stderr)


if __name__ == "__main__":
    tt.PARALLAX, tt.MPIRUN = os.path.abspath(sys.argv[1]), sys.argv[2]
    GPUS = gpu_count()
    if GPUS == 0:
        print("no GPU: skipped")
        sys.exit(77)
    unittest.main(argv=sys.argv[:1] + sys.argv[3:], verbosity=2)  # optional test names after the two
