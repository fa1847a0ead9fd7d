#!/usr/bin/env python3
"""PyTorch reference for workload W1: timm vit_base_patch16_224 classification, 224 x 224,
bf16 autocast, fused AdamW, synthetic in-memory batches (no loader), on one GPU or under
`torchrun --nproc-per-node N` (DDP). Prints one JSON line per run (rank 0).

  python3 bench/train/torch_vit_ref.py --batch 128 --mode eager
  python3 bench/train/torch_vit_ref.py --batch 128 --mode compile
  torchrun --nproc-per-node 2 bench/train/torch_vit_ref.py --batch 128 --mode eager
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from step_timing import median_step_ms, wrap_ddp  # same folder: python puts the script's folder on sys.path

# Forward multiply-adds of ViT-B/16 at 224 (timm/fvcore: 17.56 GMACs); training = 3x forward.
VIT_B16_FWD_FLOPS = 2 * 17.56e9
PEAK_BF16 = 989e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128, help="per GPU")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--grad-dtype", choices=["fp32", "bf16"], default="fp32",
                    help="DDP gradient all-reduce dtype (bf16: PyTorch's bf16_compress_hook)")
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--window", type=int, default=10,
                    help="steps per timed window (no sync inside; Parallax's train.log_every)")
    a = ap.parse_args()

    import timm

    distributed = "RANK" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    if distributed:
        dist.init_process_group("nccl", device_id=dev)
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", num_classes=1000).to(dev)
    variant = ""  # "+bf16grads" with --grad-dtype bf16
    if distributed:
        model, variant = wrap_ddp(model, [local_rank], a.grad_dtype)
    fwd = torch.compile(model) if a.mode == "compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True)
    x = torch.randn(a.batch, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (a.batch,), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step_ms = median_step_ms(step, a.iters, a.window, cuda=True)
    img_s = a.batch * world * 1000.0 / step_ms
    tflops = 3 * VIT_B16_FWD_FLOPS * a.batch / (step_ms / 1000.0) / 1e12
    if rank == 0:
        print(json.dumps({"impl": f"torch-{a.mode}{variant}", "workload": "W1 vit_b16", "gpus": world,
                          "batch_per_gpu": a.batch, "step_ms": round(step_ms, 2), "img_per_s": round(img_s, 1),
                          "tflops_per_gpu": round(tflops, 1), "mfu": round(tflops * 1e12 / PEAK_BF16, 4),
                          "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                          "torch": torch.__version__, "device": torch.cuda.get_device_name()}), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
