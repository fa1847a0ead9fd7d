#!/usr/bin/env python3
"""PyTorch reference for bench/pipeline/pp_bubble.cpp (issue 24 row 4): the same model trained with
`torch.distributed.pipelining` under the matching schedule, one JSON line per schedule (rank 0).

The model (models/mlp.h, MlpModel(W, W, W, S - 1)): S = pp x v layers of width W, one per stage;
stage s < S - 1 is Linear(W, W) + GELU, the last stage is Linear(W, W) alone; loss: the mean squared
error against y = tanh(x @ teacher) per micro-batch, the gradients divided by m (Parallax divides
each micro-batch's loss by m, torch's `scale_grads` divides the gradients: the same sum). Stages are
built by hand with `PipelineStage` (no tracer); stage s lives on rank s % pp (Parallax's and torch's
interleaved placement). m micro-batches of R rows: `step()` gets the whole m R-row batch on the
first stage's rank and the target on the last stage's rank.

Schedules (Parallax `parallel.pp_schedule` -> torch):
  gpipe       -> ScheduleGPipe                  (v = 1)
  1f1b        -> Schedule1F1B                   (v = 1; torch requires m >= pp)
  interleaved -> ScheduleInterleaved1F1B        (v = --virtual-stages per rank)
  zb          -> ScheduleInterleavedZeroBubble  with ONE stage per rank (v = 1): torch's ZB1P
                 ("the ZB1P schedule in the paper", Qi et al. 2024), the zero-bubble plan at
                 1F1B's activation memory, as Parallax's zb (ZB-H1) is; the two plans may place
                 the deferred W passes differently, so their bubbles need not match op for op.
                 torch's other zero-bubble schedules, ScheduleZBVZeroBubble and ScheduleDualPipeV,
                 need exactly two stages per rank in a V placement (another model split and
                 placement than Parallax's zb): not run.

Measured, per schedule (medians over --steps timed steps after --warmup steps; every step is
barrier, [device sync,] start clock, schedule.step(), [device sync,] barrier, [device sync,] stop):
  step_ms           rank 0's wall time of schedule.step() (what pp_bubble's step_ms is).
  bubble_mean_rank, bubble_bottleneck: pp_bubble's definitions. Each rank's compute time is the
                    host time spent inside the stage's compute calls (forward_one_chunk,
                    backward_one_chunk, backward_weight_one_chunk, and the loss), as Parallax's
                    engine times its F, B and W ops; bubble = (wall - compute) / compute, the mean
                    over ranks and the rank with the most compute. On CUDA both sides' compute
                    clocks are host time around queued kernels, not GPU time: read bubble_ideal.
  fb_ms, ideal_ms, bubble_ideal: the same on both sides, and the GPU's comparable figure. fb_ms is
                    the median time (device-synchronised) of one forward + backward of one middle
                    stage (Linear + GELU, input gradient included) on one R-row micro-batch, the
                    max over ranks; ideal_ms = m v fb_ms (a rank's compute if every stage cost what
                    a middle one does, the formula's assumption); bubble_ideal =
                    (step_ms - ideal_ms) / ideal_ms.
  bubble_formula:   (p - 1) / m, (p - 1) / (m v) for interleaved, (p - 1) / (3 m) for zb (as
                    pp_bubble's). pp_bubble's bubble_plan (its checked plan simulated) has no torch
                    counterpart.

  torchrun --nproc-per-node P bench/pipeline/torch_pp_bubble.py [--device cpu|cuda] [--micro M]
      [--width W] [--rows R] [--steps N] [--warmup K] [--schedules gpipe,1f1b,interleaved,zb]
      [--virtual-stages V]
(pp_bubble's --virtual is --virtual-stages here: torchrun takes a bare --virtual for its own
--virtual-local-rank.)
--device cpu: gloo, one thread per rank (pp_bubble's at::set_num_threads(1)); cuda: NCCL, rank i on
GPU LOCAL_RANK, fp32 with TF32 off (LibTorch's default, which pp_bubble keeps).
"""
import argparse
import inspect
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb": ScheduleInterleavedZeroBubble,
}
MULTI = {"interleaved", "zb"}  # schedules that take a list of stages


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def upper_median(xs):
    # pp_bubble sorts and takes element size / 2 (the upper median for an even count).
    return sorted(xs)[len(xs) // 2]


def all_reduce(value, op, dev):
    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=op)
    return t.item()


def build_layers(stages, width, dev):
    """Every rank builds the whole model from the same seed (as pp_bubble does) and keeps its own."""
    torch.manual_seed(1)
    layers = []
    for s in range(stages):
        lin = nn.Linear(width, width)
        layers.append(nn.Sequential(lin, nn.GELU()) if s < stages - 1 else nn.Sequential(lin))
    teacher = torch.randn(width, width) / width ** 0.5
    return [layer.to(dev) for layer in layers], teacher


def stage_fb_ms(width, rows, dev, warmup=3, reps=20):
    """Median ms of one forward + backward of a middle stage (Linear + GELU, input gradient too)."""
    lin = nn.Linear(width, width).to(dev)
    x = torch.randn(rows, width, device=dev, requires_grad=True)
    g = torch.randn(rows, width, device=dev)
    times = []
    for i in range(warmup + reps):
        sync(dev)
        t0 = time.perf_counter()
        F.gelu(lin(x)).backward(g)
        sync(dev)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return upper_median(times)


class ComputeClock:
    """Host time spent inside the wrapped compute calls of this rank (nested calls counted once)."""

    def __init__(self):
        self.ms = 0.0
        self.depth = 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.ms += (time.perf_counter() - t0) * 1e3
        return timed


def run_schedule(kind, a, rank, world, dev):
    v = a.virtual if kind == "interleaved" else 1
    stages = world * v
    layers, teacher = build_layers(stages, a.width, dev)
    mine = [s for s in range(stages) if s % world == rank]
    # Shapes inferred from the first (warm-up) step: torch's static mode wants every gradient's
    # metadata too, and the first step is untimed on both sides.
    pipe_stages = [PipelineStage(layers[s], s, stages, dev) for s in mine]
    cls = SCHEDULES[kind]
    schedule = cls(pipe_stages if kind in MULTI else pipe_stages[0], n_microbatches=a.micro,
                   loss_fn=F.mse_loss, scale_grads=True)
    params = [p for s in mine for p in layers[s].parameters()]
    # Parallax steps SGD (momentum 0.9, lr 0) outside the timed region; so does this.
    opt = torch.optim.SGD(params, lr=0.0, momentum=0.9)

    clock = ComputeClock()
    for st in pipe_stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(st, name, clock.wrap(getattr(st, name)))
    schedule._maybe_compute_loss = clock.wrap(schedule._maybe_compute_loss)

    # The whole step's batch on the CPU first, from one seed on every rank (pp_bubble draws its
    # micro-batches after building the model).
    x = torch.randn(a.micro * a.rows, a.width)
    y = torch.tanh(x @ teacher)
    x, y = x.to(dev), y.to(dev)
    first, last = 0 in mine, stages - 1 in mine
    # torch >= 2.10 can skip merging the last stage's outputs (Parallax keeps none); older ones merge.
    step_kwargs = {"target": y if last else None}
    if "return_outputs" in inspect.signature(schedule.step).parameters:
        step_kwargs["return_outputs"] = False

    fb = all_reduce(stage_fb_ms(a.width, a.rows, dev), dist.ReduceOp.MAX, dev)

    bubbles, bottleneck, walls = [], [], []
    for step in range(a.warmup + a.steps):
        sync(dev)
        dist.barrier()
        clock.ms = 0.0
        t0 = time.perf_counter()
        args = (x,) if first else ()
        schedule.step(*args, **step_kwargs)
        sync(dev)
        dist.barrier()
        sync(dev)
        wall = (time.perf_counter() - t0) * 1e3
        opt.step()
        opt.zero_grad(set_to_none=False)
        compute = clock.ms
        b = all_reduce((wall - compute) / compute, dist.ReduceOp.SUM, dev) / world
        cmax = all_reduce(compute, dist.ReduceOp.MAX, dev)
        if step >= a.warmup:
            bubbles.append(b)
            bottleneck.append((wall - cmax) / cmax)
            walls.append(wall)

    step_ms = upper_median(walls)
    ideal = a.micro * v * fb
    p, m = world, a.micro
    formula = (p - 1) / (m * v) if kind == "interleaved" else (p - 1) / (3 * m) if kind == "zb" \
        else (p - 1) / m
    if rank == 0:
        print(json.dumps({
            "schedule": kind, "pp": p, "virtual_stages": v, "micro_batches": m, "width": a.width,
            "rows": a.rows, "bubble_mean_rank": round(upper_median(bubbles), 4),
            "bubble_bottleneck": round(upper_median(bottleneck), 4),
            "bubble_formula": round(formula, 4), "step_ms": round(step_ms, 2),
            "device": dev.type, "fb_ms": round(fb, 4), "ideal_ms": round(ideal, 2),
            "bubble_ideal": round((step_ms - ideal) / ideal, 4), "impl": "torch",
            "torch_schedule": cls.__name__, "torch": torch.__version__}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (pp_bubble: 2)")
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved,zb")
    # torchrun reads a bare --virtual as an abbreviation of its own --virtual-local-rank.
    ap.add_argument("--virtual-stages", "--virtual", dest="virtual", type=int, default=2,
                    help="stages per rank under interleaved (pp_bubble's --virtual)")
    a = ap.parse_args()
    for kind in a.schedules.split(","):
        if kind not in SCHEDULES:
            ap.error(f"--schedules: unknown schedule {kind!r} (known: {', '.join(SCHEDULES)})")

    torch.set_num_threads(1)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        for kind in a.schedules.split(","):
            run_schedule(kind, a, rank, world, dev)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
