#!/usr/bin/env python3
"""PyTorch reference for comm_bench: bus bandwidth of torch.distributed all_reduce,
reduce_scatter_tensor and all_gather_into_tensor (NCCL on GPUs, gloo on CPU), same sizes, method
and JSON lines as bench/comm/comm_bench.cpp (impl "torch").

    torchrun --nproc-per-node 2 bench/comm/torch_comm_bench.py [--max-bytes 1G] [--step 4]

Method: per configuration, warm-up runs, then iterations (each after a barrier, timed on the host
until the op finished: torch.cuda.synchronize on GPU) until min-iters and target-s are both reached
or max-iters is hit; the time is the median over iterations of the slowest rank's time.
"""
import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist


def parse_bytes(s):
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    s = s.strip().lower()
    return int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(float(s))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-bytes", default="1K")
    ap.add_argument("--max-bytes", default="")
    ap.add_argument("--step", type=int, default=4)
    ap.add_argument("--ops", default="all_reduce,reduce_scatter,all_gather")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--min-iters", type=int, default=5)
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--target-s", type=float, default=0.3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = ap.parse_args()

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(seconds=600))
    n, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    dt = getattr(torch, a.dtype)
    elem = torch.tensor([], dtype=dt).element_size()
    max_bytes = parse_bytes(a.max_bytes) if a.max_bytes else (1 << 30 if gpu else 64 << 20)

    def sync():
        if gpu:
            torch.cuda.synchronize()

    def slowest(v):
        t = torch.tensor([v], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    for op in a.ops.split(","):
        b = parse_bytes(a.min_bytes)
        while b <= max_bytes:
            numel = max(n, (b // elem // n) * n)
            full = torch.randn(numel, device=dev).to(dt)
            chunk = torch.empty(numel // n, device=dev, dtype=dt)
            if op == "all_reduce":
                run = lambda: dist.all_reduce(full)
            elif op == "reduce_scatter":
                run = lambda: dist.reduce_scatter_tensor(chunk, full)
            else:
                run = lambda: dist.all_gather_into_tensor(full, chunk)
            for _ in range(a.warmup):
                run()
            sync()
            times, spent = [], 0.0
            while len(times) < a.max_iters and (len(times) < a.min_iters or spent < a.target_s):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                run()
                sync()
                dtm = time.perf_counter() - t0
                times.append(slowest(dtm))
                spent = slowest(spent + dtm)
            times.sort()
            med = times[len(times) // 2]
            algbw = numel * elem / med / 1e9
            factor = 0.0 if n == 1 else (2.0 * (n - 1) / n if op == "all_reduce" else (n - 1) / n)
            if rank == 0:
                print(json.dumps({"op": op, "impl": "torch", "backend": "nccl" if gpu else "gloo", "ranks": n,
                                  "dtype": a.dtype, "bytes": numel * elem, "iters": len(times),
                                  "median_us": round(med * 1e6, 2), "algbw_GBps": round(algbw, 4),
                                  "busbw_GBps": round(algbw * factor, 4)}), flush=True)
            b *= a.step
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
