#!/usr/bin/env python3
"""precision.mode=fp8 (issue 39) through the `parallax` binary on Hopper GPUs: the ViT blocks' linear
layers in FP8 (kernels/fp8.h) must train like bf16.

- bev/base (configs/bench/w2_bev_base.yaml, synthetic scenes, SGD with momentum) for 200 steps on
  one GPU: the loss at the end is within 1% of the same run in bf16, both run here, with a second
  bf16 run as the control (its spread is printed);
- the same under DDP and ZeRO-3 on two GPUs and under tensor parallelism tp 2 (whose sharded
  tensors' amax is all-reduced over the tp group, so both ranks cast with one scale);
- and no single step after the first 60 (the warm-up transient) spikes above the bf16 runs' own
  maximum over the same steps by more than 2%;
- activation checkpointing recomputes the FP8 blocks exactly: every loss equals the run without it;
- the delayed recipe resumes bitwise: a run checkpointed at step 3 and resumed computes step 4's
  loss from the restored weights and amax histories exactly as the uninterrupted run does; the same
  under pipeline parallelism (pp 2 on two GPUs, built whole and with parallel.meta_init), whose
  losses also stay near one GPU's.

The 1% is the issue's acceptance bound, not derived from the arithmetic: FP8's rounding (3 mantissa
bits forward, 2 for gradients) changes every step's update, and what is asserted is that training
is not hurt by it. Each test prints the measured difference.

Exits 77 (ctest: skipped) without a GPU of compute capability 8.9 or newer; the two-GPU tests skip
on one GPU.

Usage: test_fp8_gpu.py <parallax binary> <mpirun>
"""
import os
import statistics
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_train as tt  # noqa: E402  (shared helpers: run, metrics, RunDirTest)

SRC = tt.SRC
W1 = os.path.join(SRC, "configs", "bench", "w1_vit_b16.yaml")
W2 = os.path.join(SRC, "configs", "bench", "w2_bev_base.yaml")
STEPS = 200
# The final loss: the mean of the last 50 steps' losses (train.log_every=1). The batches cycle
# through 8 distinct synthetic scenes whose losses differ by ~2% at this point of training, so one
# step's loss measures which scene came last as much as the model; 50 steps average over every
# scene about six times.
LAST = 50
# Spikes: from step 61 (after the warm-up transient, whose losses fall from ~40 to ~5.5), no FP8
# step may exceed the larger of the two bf16 runs' maxima over the same steps by more than 2%.
# Measured 2026-11-30 on 2 x H200 (bev/base, these settings, 7 runs of 200 steps): the bf16 and
# FP8 maxima over steps 61-200 all lie in [5.514, 5.544], a spread of 0.54%, so 2% is ~4x it; the
# isolated one-step spikes seen in three FP8 runs logged every 10 steps were +4% to +10% (issue 39,
# open).
SPIKE_FROM, SPIKE_BOUND = 61, 0.02


def final_loss(run_dir):
    rows = tt.metrics(run_dir)
    return statistics.mean(r["loss"] for r in rows[-LAST:])


def late_max(run_dir):
    return max(r["loss"] for r in tt.metrics(run_dir) if r["step"] >= SPIKE_FROM)


fp8_gpu = tt.fp8_gpu


class Fp8GpuTest(tt.RunDirTest):
    # SGD with momentum: under AdamW two bf16 runs of bev/base already end 6.9% apart after 200
    # steps (measured 2026-11-30 on an H200: the grid sampler's atomics reorder sums from run to
    # run, and AdamW turns each rounding difference into a full-size update, CONVENTIONS.md), so
    # the comparison would measure chaos, not FP8. The control run below prints that spread.
    COMMON = ["train.device=cuda", f"train.steps={STEPS}", "train.log_every=1", "optim.name=sgd", "optim.lr=0.01",
              "optim.momentum=0.9"]

    def train(self, config, name, *extra, ranks=1):
        return tt.run(["train", "--config", config, f"experiment.output_dir={self.d}", f"experiment.name={name}",
                       *self.COMMON, *extra], ranks, 900)

    def compare(self, label, *extra, ranks=1):
        for mode in ("bf16", "fp8", "bf16again"):
            p = self.train(W2, f"{label}_{mode}", f"precision.mode={mode[:4]}", *extra, ranks=ranks)
            if mode == "fp8":
                self.assertIn("precision fp8:", p.stdout + p.stderr)
        runs = {m: tt.metrics(os.path.join(self.d, f"{label}_{m}")) for m in ("bf16", "fp8", "bf16again")}
        for m, rows in runs.items():
            print(f"  {label} {m}: " + " ".join(f"{r['step']}:{r['loss']:.4f}" for r in rows[19::20]), file=sys.stderr)
        a = final_loss(os.path.join(self.d, f"{label}_bf16"))
        b = final_loss(os.path.join(self.d, f"{label}_fp8"))
        c = final_loss(os.path.join(self.d, f"{label}_bf16again"))
        rel = abs(b - a) / abs(a)
        print(f"  {label}: after {STEPS} steps bf16 {a:.4f}, fp8 {b:.4f} ({rel:.4%} apart), bf16 again {c:.4f} "
              f"({abs(c - a) / abs(a):.4%} apart)", file=sys.stderr)
        self.assertLess(a, runs["bf16"][0]["loss"], "bf16 did not train")
        self.assertLessEqual(rel, 0.01)
        peak = max(late_max(os.path.join(self.d, f"{label}_{m}")) for m in ("bf16", "bf16again"))
        spike = late_max(os.path.join(self.d, f"{label}_fp8"))
        print(f"  {label}: largest loss from step {SPIKE_FROM}: fp8 {spike:.4f}, bf16 {peak:.4f}", file=sys.stderr)
        self.assertLessEqual(spike, peak * (1 + SPIKE_BOUND), "an FP8 step spiked above bf16's losses")

    def test_bev_base_200_steps_end_within_one_percent_of_bf16(self):
        self.compare("bev_base", "data.batch_size=8")

    # Issue 39 measured this run 18.8% above bf16 once (2026-11-30, logged every 10 steps, the final
    # loss from 3 logged steps). Rerun with every step logged, ZeRO-3 and DDP ended within 0.1% of
    # bf16 (docs/PERFORMANCE.md, "The ZeRO-3 gap, rerun"). Isolated one-step spikes seen when logging
    # every 10 steps (3 of 200 logged FP8 steps on two GPUs, all in one call; none in ~680 bf16
    # steps, ~220 one-GPU FP8 steps or 600 two-GPU FP8 steps logged every step) stay open there.
    @unittest.skipIf(tt.gpu_count() < 2, "needs two GPUs")
    def test_zero3_on_two_gpus(self):
        self.compare("zero3", "data.batch_size=4", "parallel.zero.stage=3", ranks=2)

    @unittest.skipIf(tt.gpu_count() < 2, "needs two GPUs")
    def test_ddp_on_two_gpus(self):
        self.compare("ddp", "data.batch_size=4", ranks=2)

    @unittest.skipIf(tt.gpu_count() < 2, "needs two GPUs")
    def test_tensor_parallel_tp2(self):
        self.compare("tp2", "data.batch_size=8", "parallel.tp=2", ranks=2)

    def test_activation_checkpointing_matches_the_run_without(self):
        # train.activation_checkpointing=full recomputes each block's forward, FP8 casts included,
        # in its backward: the same tensors cast with the same scales (the delayed recipe's history
        # only changes when a step is rolled; re-recording an amax is a MAX), so every step's loss
        # equals the run without checkpointing bit for bit, under both recipes.
        common = ["model.size=tiny", "train.benchmark=false", "data.synthetic=true", "data.batch_size=16",
                  "precision.mode=fp8", "precision.fp8.amax_history=4", "train.log_every=1", "train.steps=5"]
        for recipe in ("current", "delayed"):
            for ac in ("none", "full"):
                self.train(W1, f"{recipe}_{ac}", *common, f"precision.fp8.recipe={recipe}",
                           f"train.activation_checkpointing={ac}")
            a = tt.losses(os.path.join(self.d, f"{recipe}_none"))
            b = tt.losses(os.path.join(self.d, f"{recipe}_full"))
            print(f"  {recipe}: " + " ".join(f"{s}:{a[s]:.6f}/{b[s]:.6f}" for s in sorted(a)), file=sys.stderr)
            self.assertEqual(sorted(a), list(range(1, 6)))
            self.assertEqual(a, b, f"{recipe}: checkpointed losses differ")

    def test_folded_gelu_changes_no_bit(self):
        # Under the delayed recipe fc2 casts gelu(pre) itself from step 2 on (bench/NOTES.md lever 39);
        # PARALLAX_FP8_NO_GELU_FOLD keeps the GELU kernel and the cast apart. Every loss is equal.
        common = ["model.size=tiny", "train.benchmark=false", "data.synthetic=true", "data.batch_size=16",
                  "precision.mode=fp8", "precision.fp8.recipe=delayed", "precision.fp8.amax_history=4",
                  "train.log_every=1", "train.steps=5"]
        self.train(W1, "fold", *common)
        os.environ["PARALLAX_FP8_NO_GELU_FOLD"] = "1"
        try:
            self.train(W1, "nofold", *common)
        finally:
            del os.environ["PARALLAX_FP8_NO_GELU_FOLD"]
        a, b = tt.losses(os.path.join(self.d, "fold")), tt.losses(os.path.join(self.d, "nofold"))
        self.assertEqual(sorted(a), list(range(1, 6)))
        self.assertEqual(a, b)

    def test_delayed_recipe_resumes_bitwise(self):
        common = ["model.size=tiny", "train.benchmark=false", "data.synthetic=true", "data.batch_size=16",
                  "precision.mode=fp8", "precision.fp8.recipe=delayed", "precision.fp8.amax_history=4",
                  "train.log_every=1", "checkpoint.every=3"]
        self.train(W1, "ref", *common, "train.steps=6")
        self.train(W1, "legs", *common, "train.steps=3")
        self.train(W1, "legs", *common, "train.steps=6", "train.resume=auto")
        a, b = tt.losses(os.path.join(self.d, "ref")), tt.losses(os.path.join(self.d, "legs"))
        self.assertEqual(sorted(b), list(range(1, 7)))
        for s in range(1, 5):
            # Steps 1-3 are the same computation; step 4's forward reads the restored weights and
            # histories (its backward is the first place where run-to-run atomics could enter).
            self.assertEqual(a[s], b[s], f"loss at step {s}")

    @unittest.skipIf(tt.gpu_count() < 2, "needs two GPUs")
    def test_pipeline_pp2_trains_and_resumes_bitwise(self):
        # parallel.pp=2 (1f1b, 4 micro-batches, NCCL between the stages), delayed recipe: each stage's
        # layers record and roll their own histories, and the checkpoint takes each layer's history
        # from the rank whose stage runs it (pipeline rank 0's copy of stage 1's layers never
        # changes). Resumed at step 3, built whole and built without storage (parallel.meta_init,
        # where the model is read into its recipes before the FP8 layers exist), step 4's loss is
        # the uninterrupted run's bit for bit. Against one GPU with the same micro-batches the
        # losses stay within 2e-2 (each stage runs the same FP8 casts and GEMMs on the same
        # micro-batches; the global gradient norm for clipping is summed in another order, and an
        # FP8 rounding that this flips moves a value by up to 2^-3: the bf16 bound of
        # test_pipeline.py, not a derived one; the test prints the measured difference).
        common = ["model.size=tiny", "train.benchmark=false", "data.synthetic=true", "data.batch_size=16",
                  "train.grad_accum=4", "precision.mode=fp8", "precision.fp8.recipe=delayed",
                  "precision.fp8.amax_history=4", "train.log_every=1", "checkpoint.every=3", "optim.grad_clip=1.0"]
        pp = ["parallel.pp=2", "parallel.pp_schedule=1f1b"]
        self.train(W1, "one", *common, "train.steps=6")
        self.train(W1, "ref", *common, *pp, "train.steps=6", ranks=2)
        a, one = tt.losses(os.path.join(self.d, "ref")), tt.losses(os.path.join(self.d, "one"))
        self.assertEqual(sorted(a), list(range(1, 7)))
        worst = max(abs(a[s] - one[s]) / abs(one[s]) for s in one)
        print(f"  pp2 fp8 against one GPU: max loss rel diff {worst:.3g}", file=sys.stderr)
        for s in one:
            self.assertAlmostEqual(a[s], one[s], delta=2e-2 * abs(one[s]), msg=f"step {s}")
        for meta in ("false", "true"):
            name = f"legs_{meta}"
            self.train(W1, name, *common, *pp, "train.steps=3", ranks=2)
            p = self.train(W1, name, *common, *pp, "train.steps=6", "train.resume=auto",
                           f"parallel.meta_init={meta}", ranks=2)
            self.assertEqual("model built without storage" in p.stdout + p.stderr, meta == "true")
            b = tt.losses(os.path.join(self.d, name))
            self.assertEqual(sorted(b), list(range(1, 7)))
            for s in range(1, 5):
                self.assertEqual(a[s], b[s], f"meta_init={meta}: loss at step {s}")

if __name__ == "__main__":
    tt.PARALLAX, tt.MPIRUN = sys.argv[1], sys.argv[2]
    if not fp8_gpu():
        print("test_fp8_gpu: no GPU with FP8 tensor cores, skipped")
        sys.exit(77)
    sys.argv = sys.argv[:1] + sys.argv[3:]
    unittest.main(verbosity=2)
