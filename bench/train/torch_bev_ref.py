#!/usr/bin/env python3
"""PyTorch reference for workload W2: the `bev` perception model (`model.name: bev`, default size
`base`: 6 cameras, ViT-B/16 backbone, camera-geometry view transformer, residual conv BEV encoder,
segmentation + CenterPoint heads), bf16 autocast, fused AdamW, synthetic in-memory batches (no
loader), on one GPU or under `torchrun --nproc-per-node N` (DDP). Prints one JSON line per run
(rank 0).

The model is Parallax's C++ PerceptionModel (models/perception_model.cpp and the files it uses)
written again in plain torch.nn: the same layers, parameter names and shapes (a C++ state dict
loads with strict=True), the same forward computation (uint8 normalisation, ViT with fused qkv and
SDPA, per-camera compacted grid_sample of the projected pillar reference points in float32,
scatter-add mean over cameras, seen flags, 1x1-conv lift, query embedding, BEV blocks, heads,
bilinear resampling to the label grid) and the same losses (class-balanced cross-entropy,
CenterNet focal loss, box L1 at the centre cells). Checked on CPU in float32 against the C++ model
with its own parameters and example batch (bev/tiny and bev/base at both scenes): identical outputs,
loss terms and gradients (2026-11-22; the C++ patch embedding has since become a GEMM on the patch
rows, the same sums in another order, so they now agree to float32 rounding, not bitwise). Only the ViT backbone is mirrored (W2 uses it), not `model.backbone: conv`.
Under bf16 autocast the ViT residual stream is float32, as eager PyTorch does it. `--mode compile`
compiles the model except the view transformer's sampling step, whose sizes come from a host sync
(as in the C++ model) and would make dynamo recompile for every batch.

A sample is one scene: 6 camera images plus its camera geometry and targets; img_per_s counts
scenes. FLOPs: the forward FLOPs per sample are computed with the same analytic formula as the C++
model's forward_flops_per_sample() (models/layers.h cost convention: matmuls, convolutions and
attention QK^T/AV at 2 FLOPs per multiply-add; training = 3x forward), unless
--fwd-gflops-per-sample gives a number (e.g. the one `parallax train` logs); the JSON says which.

Scenes: `--scene benchmark` (default) is models::benchmark_scene(size), the scene `parallax train`
builds the model for with synthetic batches (small..3b: 6 x 256x704 images, 200 x 200 BEV at 0.5 m
over [-50, 50]^2; tiny: the defaults); `--scene default` is core::SceneSpec's defaults (6 x 128x224
images, 100 x 100 BEV labels at 0.5 m over [-25, 25]^2), the scene of `parallax datagen`'s defaults. bench/train/run_w2.sh picks the one whose parameter
count matches what `parallax train` logged.

  python3 bench/train/torch_bev_ref.py --batch 32 --mode eager
  python3 bench/train/torch_bev_ref.py --batch 32 --mode compile
  torchrun --nproc-per-node 2 bench/train/torch_bev_ref.py --batch 32 --mode eager
  torchrun --nproc-per-node 2 bench/train/torch_bev_ref.py --size large --batch 8 --tp 2 [--sp]
  python3 bench/train/torch_bev_ref.py --device cpu --size tiny --batch 2 --warmup 1 --iters 3
  python3 bench/train/torch_bev_ref.py --size base --params-only   # parameters / FLOPs per module
  python3 bench/train/torch_bev_ref.py --device cpu --size tiny --scene default --batch 1 \
      --weights runs/X/export/model.safetensors   # from a run's `parallax export --format safetensors`

Tensor parallelism (`--tp N`, `--sp`; issue 24 row 3): PyTorch DTensor TP as its documentation
and torchtitan apply it (`parallelize_module` over a 1-D device mesh of the N ranks; every rank
sees the same batch): in every ViT block `qkv` and `fc1` ColwiseParallel, `proj` and `fc2`
RowwiseParallel; with `--sp` also the LayerNorms SequenceParallel (tokens sharded along dim 1
between the blocks), each sub-block's input gathered by PrepareModuleInput, the row layers'
outputs reduce-scattered to Shard(1), the first block's input sharded and the final norm's output
gathered before the neck. The layers Parallax keeps replicated (patch embedding, neck, view
transformer, BEV encoder, heads) stay replicated here too. The fused qkv weight's rows are
reordered once at setup into [q, k, v] blocks per rank, so DTensor's contiguous Colwise shard gives
each rank whole heads (Parallax's per-part split, Megatron's `stride`): the reordered model
computes the same function as the dense one. `--check` prints the first two losses (the second
after one SGD step at lr 1e-3 instead of AdamW, so it checks the gradients too); on CPU in float32, bev/small, one scene,
`--tp 2` and `--tp 2 --sp` give the one-process losses within 1e-6 relative (2026-11-28):
  python3 bench/train/torch_bev_ref.py --device cpu --size small --scene default --batch 1 \
      --warmup 0 --iters 2 --window 1 --check
  torchrun --nproc-per-node 2 bench/train/torch_bev_ref.py <the same> --tp 2 [--sp]
DTensor shards the tokens evenly only when tp divides them (the benchmark scene's 16 x 44 = 704
tokens: tp 2 and 4); an uneven split failed on gloo here.

Files (bench/train/): this script is the timing driver (command line, optimizer, the timed loop,
the JSON line); bev_ref_spec.py holds sizes, scenes and the analytic FLOPs, bev_ref_model.py the
model, bev_ref_geometry.py the camera projection, bev_ref_loss.py the losses, bev_ref_batch.py the
synthetic batches and bev_ref_tp.py the DTensor TP plan.
"""
import argparse
import json
import resource

import torch
import torch.distributed as dist

# Same folder: python puts the script's folder on sys.path.
from bev_ref_batch import example_batch
from bev_ref_loss import bev_loss
from bev_ref_model import PerceptionModel, group_parameter_counts
from bev_ref_spec import SIZE_PRESETS, analytic_cost, make_bev_spec, make_scene
from bev_ref_tp import apply_dtensor_tp, reorder_qkv_for_tp, split_dtensor_groups
from step_timing import init_process, median_step_ms, to_float8, wrap_ddp

PEAK_BF16 = 989e12  # H100/H200 dense bf16, as Parallax's trainer (train/trainer.cpp)

# ---- optimizer groups (optim/param_groups.cpp) ----------------------------------------------------------

NO_DECAY_NAMES = ("pos_embed", "cls_token", "dist_token", "bev_queries")


def param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        skip = p.dim() <= 1 or any(s in name for s in NO_DECAY_NAMES)
        (no_decay if skip else decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]]


# ---- benchmark --------------------------------------------------------------------------------------------


def build(size, scene_name, seed=0):
    torch.manual_seed(seed)
    spec = make_bev_spec(size, make_scene(size, scene_name))
    return spec, PerceptionModel(spec)


def cost_report(spec, model):
    analytic = analytic_cost(spec)
    counted = group_parameter_counts(model)
    total_counted = sum(p.numel() for p in model.parameters())
    rows = {name: {"params": counted[name], "params_analytic": params, "fwd_gflops": round(flops / 1e9, 6)}
            for name, params, flops in analytic}
    sc = spec.scene
    return {"model": f"bev/{spec.size} (vit)",
            "scene": f"{sc.num_cameras} x {sc.image_height}x{sc.image_width}, BEV labels "
                     f"{sc.bev_x_cells()}x{sc.bev_y_cells()} @ {sc.bev_resolution} m, "
                     f"query {spec.query.nx}x{spec.query.ny}",
            "params": total_counted, "params_analytic": sum(r[1] for r in analytic),
            "fwd_gflops_per_sample": round(sum(r[2] for r in analytic) / 1e9, 6), "groups": rows}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="samples (6-camera scenes) per GPU")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--float8", action="store_true",
                    help="torchao float8 training on the ViT blocks' linear layers (with --mode compile, as torchao advises)")
    ap.add_argument("--grad-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="DDP gradient all-reduce dtype (bf16: PyTorch's bf16_compress_hook)")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--window", type=int, default=10,
                    help="steps per timed window (no sync inside; Parallax's train.log_every)")
    ap.add_argument("--size", choices=list(SIZE_PRESETS), default="base")
    ap.add_argument("--scene", choices=["benchmark", "default"], default="benchmark",
                    help="benchmark: models::benchmark_scene(size), as `parallax train` with synthetic "
                         "batches; default: core::SceneSpec's defaults")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: bf16 autocast; cpu: float32 (smoke tests)")
    ap.add_argument("--fwd-gflops-per-sample", type=float, default=0.0,
                    help="forward GFLOPs per sample for tflops/mfu (default: the C++ model's analytic formula)")
    ap.add_argument("--distinct", type=int, default=8, help="distinct synthetic batches, cycled (as Parallax)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--params-only", action="store_true", help="print parameters / FLOPs per module and exit")
    ap.add_argument("--tp", type=int, default=1,
                    help="DTensor tensor parallelism over all ranks (torchrun; tp = world size, one batch)")
    ap.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism (DTensor SequenceParallel)")
    ap.add_argument("--weights", default="",
                    help="start from a Parallax whole-model export (`parallax export --format "
                         "safetensors`), loaded with strict=True: the same names and shapes")
    ap.add_argument("--check", action="store_true",
                    help="print the first two steps' losses (the second after one SGD step: the "
                         "gradients; float32 on CPU: compare --tp N [--sp] with one process)")
    return ap.parse_args()


def parallelize(a, model, dev, world, distributed, local_rank):
    """The model under --tp (DTensor) or DDP, its optimizer and the variant tag of the JSON line."""
    cuda = dev.type == "cuda"
    variant = ""  # "+bf16grads" with --grad-dtype bf16, "-dtensor-tpN[-sp]" with --tp N
    if a.sp and a.tp < 2:
        raise SystemExit("torch_bev_ref: --sp needs --tp >= 2")
    if a.tp > 1:
        if world != a.tp:
            raise SystemExit(f"torch_bev_ref: --tp {a.tp} runs on exactly {a.tp} ranks (torchrun "
                             f"--nproc-per-node {a.tp}), not {world}")
        from torch.distributed.device_mesh import init_device_mesh
        reorder_qkv_for_tp(model, a.tp)
        apply_dtensor_tp(model, init_device_mesh(dev.type, (a.tp,)), a.sp)
        variant = f"-dtensor-tp{a.tp}" + ("-sp" if a.sp else "")
        groups = split_dtensor_groups(param_groups(model, a.weight_decay))
    else:
        groups = param_groups(model, a.weight_decay)
    # --check: SGD, whose step is linear in the gradient (AdamW's first step is lr x sign(g), blind to
    # a gradient's size), so the second loss shows a wrong gradient.
    opt = torch.optim.SGD(groups, lr=1e-3) if a.check else torch.optim.AdamW(groups, lr=a.lr, fused=cuda)
    if distributed and a.tp == 1:
        model, variant = wrap_ddp(model, [local_rank] if cuda else None, a.grad_dtype)
    if a.float8:
        to_float8(model.module if hasattr(model, "module") else model)
        variant += "+float8"
    return model, opt, variant


def time_steps(a, spec, fwd, opt, dev, rank):
    """Median step time (ms) over the timed windows after the warm-up, and the first two losses
    (--check)."""
    cuda = dev.type == "cuda"
    dp_rank = rank // a.tp  # the tp ranks of a model replica see the same batches
    gen = torch.Generator().manual_seed(1000 + dp_rank)  # each data-parallel rank draws its own batches
    batches = [{k: v.to(dev) for k, v in example_batch(spec, a.batch, gen).items()} for _ in range(a.distinct)]
    counter = [0]

    first_loss = []

    def step():
        batch = batches[counter[0] % len(batches)]
        counter[0] += 1
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss, _ = bev_loss(spec, batch, fwd(batch))
        if a.check and len(first_loss) < 2:
            first_loss.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return median_step_ms(step, a.iters, a.window, cuda), first_loss


def main():
    a = parse_args()

    if a.params_only:
        spec, model = build(a.size, a.scene)
        print(json.dumps(cost_report(spec, model)), flush=True)
        return

    dev, distributed, rank, world, local_rank = init_process(a.device)
    cuda = dev.type == "cuda"
    spec, model = build(a.size, a.scene, seed=0)
    if a.weights:
        from safetensors.torch import load_file
        model.load_state_dict(load_file(a.weights), strict=True)
    model = model.to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    analytic_flops = sum(r[2] for r in analytic_cost(spec))
    fwd_flops = a.fwd_gflops_per_sample * 1e9 if a.fwd_gflops_per_sample > 0 else analytic_flops
    model, opt, variant = parallelize(a, model, dev, world, distributed, local_rank)
    fwd = torch.compile(model) if a.mode == "compile" else model
    step_ms, first_loss = time_steps(a, spec, fwd, opt, dev, rank)
    img_s = a.batch * (world // a.tp) * 1000.0 / step_ms  # a tp group trains one batch
    tflops = 3 * fwd_flops * a.batch / a.tp / (step_ms / 1000.0) / 1e12
    if cuda:
        peak_gb = torch.cuda.max_memory_allocated() / 2**30
        device_name = torch.cuda.get_device_name()
    else:
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS (KiB on Linux)
        device_name = "cpu"
    if rank == 0:
        sc = spec.scene
        extra = {"tp": a.tp, "sp": a.sp} if a.tp > 1 else {}
        if a.check:
            extra["first_losses"] = first_loss
        print(json.dumps({"impl": f"torch-{a.mode}{variant}", "workload": f"W2 bev_{a.size}", "gpus": world,
                          "batch_per_gpu" if a.tp == 1 else "batch_per_tp_group": a.batch, **extra, "sample": f"one {sc.num_cameras}-camera scene",
                          "scene": f"{sc.num_cameras} x {sc.image_height}x{sc.image_width}, BEV "
                                   f"{spec.query.nx}x{spec.query.ny}",
                          "step_ms": round(step_ms, 2), "img_per_s": round(img_s, 1),
                          "tflops_per_gpu": round(tflops, 1 if cuda else 4),
                          "mfu": round(tflops * 1e12 / PEAK_BF16, 4) if cuda else None,
                          "fwd_gflops_per_sample": round(fwd_flops / 1e9, 3),
                          "flops_source": "argument" if a.fwd_gflops_per_sample > 0 else "analytic (C++ formula)",
                          "params": n_params, "peak_mem_gb": round(peak_gb, 2),
                          "torch": torch.__version__, "device": device_name}), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
