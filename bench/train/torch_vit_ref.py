#!/usr/bin/env python3
"""PyTorch reference for workload W1: timm vit_base_patch16_224 classification, 224 x 224,
bf16 autocast, fused AdamW, synthetic in-memory batches (no loader), on one GPU or under
`torchrun --nproc-per-node N` (DDP, or FSDP2 with --wrap fsdp2). Prints one JSON line per run (rank 0).

  python3 bench/train/torch_vit_ref.py --batch 128 --mode eager
  python3 bench/train/torch_vit_ref.py --batch 128 --mode compile
  torchrun --nproc-per-node 2 bench/train/torch_vit_ref.py --batch 128 --mode eager
  torchrun --nproc-per-node 2 bench/train/torch_vit_ref.py --batch 128 --wrap fsdp2

--wrap fsdp2 is PyTorch FSDP2 as its documentation applies it: `fully_shard` on every transformer
block, then on the root, fp32 parameters gathered for autocast and gradients reduce-scattered in
fp32 (no MixedPrecisionPolicy): the numerics of Parallax's parallel.zero.stage=3, which gathers and
reduce-scatters fp32 too (bench/zero/compare_w1.sh runs both in one command).
"""
import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from step_timing import init_process, median_step_ms, to_float8, wrap_ddp  # same folder: python puts the script's folder on sys.path

# Forward multiply-adds of ViT-B/16 at 224 (timm/fvcore: 17.56 GMACs); training = 3x forward.
VIT_B16_FWD_FLOPS = 2 * 17.56e9
PEAK_BF16 = 989e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128, help="per GPU")
    ap.add_argument("--mode", choices=["eager", "compile", "compile-graphs"], default="eager",
                    help="compile-graphs: torch.compile(mode='reduce-overhead'), forward and backward "
                         "replayed as CUDA graphs (the comparison for Parallax's train.cuda_graph)")
    ap.add_argument("--float8", action="store_true",
                    help="torchao float8 training on the ViT blocks' linear layers (with --mode compile, as torchao advises)")
    ap.add_argument("--grad-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="DDP gradient all-reduce dtype (bf16: PyTorch's bf16_compress_hook)")
    ap.add_argument("--wrap", choices=["ddp", "fsdp2"], default="ddp",
                    help="how a torchrun run shards: DDP (replicated) or FSDP2 fully_shard (ZeRO-3)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a gloo smoke run of the script itself (tiny timings, no GPU)")
    ap.add_argument("--model", default="vit_base_patch16_224", help="timm model name")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--window", type=int, default=10,
                    help="steps per timed window (no sync inside; Parallax's train.log_every)")
    a = ap.parse_args()

    import timm

    dev, distributed, rank, world, local_rank = init_process(a.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model = timm.create_model(a.model, num_classes=1000).to(dev)
    variant = ""  # "+bf16grads" with --grad-dtype bf16, "-fsdp2" with --wrap fsdp2
    if distributed and a.wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(dev.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        variant = "-fsdp2"
    elif distributed:
        model, variant = wrap_ddp(model, [local_rank] if cuda else None, a.grad_dtype)
    if a.float8:
        to_float8(model.module if hasattr(model, "module") else model)
        variant += "+float8"
    if a.mode == "compile":
        fwd = torch.compile(model)
    elif a.mode == "compile-graphs":
        fwd = torch.compile(model, mode="reduce-overhead")
    else:
        fwd = model
    # Fused AdamW on both sides (Parallax's optimizer is ATen's fused kernel); FSDP2's DTensor
    # parameters take it too.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=cuda)
    x = torch.randn(a.batch, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (a.batch,), device=dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step_ms = median_step_ms(step, a.iters, a.window, cuda=cuda)
    img_s = a.batch * world * 1000.0 / step_ms
    w1 = a.model == "vit_base_patch16_224"
    tflops = 3 * VIT_B16_FWD_FLOPS * a.batch / (step_ms / 1000.0) / 1e12 if w1 else float("nan")
    if rank == 0:
        print(json.dumps({"impl": f"torch-{a.mode}{variant}", "workload": "W1 vit_b16" if w1 else a.model, "gpus": world,
                          "batch_per_gpu": a.batch, "step_ms": round(step_ms, 2), "img_per_s": round(img_s, 1),
                          "tflops_per_gpu": round(tflops, 1), "mfu": round(tflops * 1e12 / PEAK_BF16, 4),
                          "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                          "torch": torch.__version__,
                          "device": torch.cuda.get_device_name() if cuda else "cpu"}), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
