"""Step timing, DDP wrapping and torchao float8 conversion shared by the PyTorch reference scripts (torch_vit_ref.py,
torch_bev_ref.py).

Parallax reports the wall time of each logged interval of `train.log_every` steps divided by its
step count, with no device synchronisation inside an interval. The references measure the same
way: windows of `window` consecutive steps between two CUDA events (host clock on CPU), no sync
inside a window, and the median over the windows. Synchronising after every step instead would
leave the GPU idle while the host launches the next step's first kernels, charging the reference
for a gap Parallax does not pay.
"""
import os
import statistics
import time

import torch
import torch.distributed as dist


def init_process(device):
    """This process's device ("cuda": cuda:LOCAL_RANK, made current; "cpu") and, under torchrun
    (RANK set), its process group (NCCL on GPUs, gloo on CPUs). Returns (device, distributed,
    rank, world, local_rank)."""
    distributed = "RANK" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if not distributed:
        return dev, False, 0, 1, local_rank
    if dev.type == "cuda":
        dist.init_process_group("nccl", device_id=dev)
    else:
        dist.init_process_group("gloo")
    return dev, True, dist.get_rank(), dist.get_world_size(), local_rank


def median_step_ms(step, iters, window, cuda):
    """Runs `step` iters times (rounded down to whole windows, at least one window) and returns the
    median over windows of the mean step time in milliseconds."""
    window = max(1, min(window, iters))
    times = []
    for _ in range(max(1, iters // window)):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(window):
                step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / window)
        else:
            t0 = time.perf_counter()
            for _ in range(window):
                step()
            times.append(1000.0 * (time.perf_counter() - t0) / window)
    return statistics.median(times)


def wrap_ddp(model, device_ids, grad_dtype):
    """PyTorch DDP as the references run it (gradient_as_bucket_view, as Parallax's flat buckets);
    grad_dtype "bf16" registers PyTorch's bf16_compress_hook, the counterpart of Parallax's
    parallel.ddp.reduce_dtype=bf16. Returns the model and the suffix of the run's "impl" label."""
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    if grad_dtype == "fp32":
        return ddp, ""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return ddp, "+bf16grads"


def to_float8(model):
    """torchao's float8 training (convert_to_float8_training with its default Float8LinearConfig:
    tensorwise current scaling, E4M3 forward, E5M2 gradients) on the ViT blocks' linear layers only
    (qkv, proj, fc1, fc2), the layers Parallax's precision.mode=fp8 converts."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def blocks_only(mod, fqn):
        parts = fqn.split(".")
        return len(parts) >= 2 and (parts[-2], parts[-1]) in {("attn", "qkv"), ("attn", "proj"),
                                                              ("mlp", "fc1"), ("mlp", "fc2")}

    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=blocks_only)
    return model

