#!/usr/bin/env python3
"""Breaks a Chrome trace (from `parallax train ... train.profile_steps=N`, or torch.profiler's
export_chrome_trace) down by kernel class: per-step GPU time of GEMMs, attention, LayerNorm,
reductions, copies, elementwise kernels, optimizer, NCCL and convolutions, then the top kernels.
Without GPU kernels in the trace (a CPU run) it lists the top host ops instead.

With --gaps it also reports how busy the GPU was: the span from the first kernel's start to the
last kernel's end, the union of all kernel intervals over every stream (busy), the rest (idle: no
kernel running anywhere, e.g. while the GPU waits for the host to launch), and the longest idle
gaps with the kernel that ended each.

With --host (and --gaps) it asks whether the host kept the GPU fed: the lead of each kernel (its
start minus the host's launch call, matched by the profiler's correlation id; a lead near zero
means the GPU waited for the host), the lead of the kernel after each listed gap, and the host ops
on the launching thread that cover the gap, innermost first, with how many microseconds of it
each covers (what the host was busy with).

With --bubble it reports a pipeline stage's bubble from its rank's trace: the span per step, the
compute (the union of every kernel's interval but NCCL's, over all streams: a NCCL receive kernel
that spins while it waits for the peer is waiting, not work) and bubble = (span - compute) /
compute, the quantity the schedules' formulas give ((p - 1) / m for 1f1b and gpipe), printed last
as `bubble <value>`. Run it on each rank's trace; the formula's rank is the one with the most
compute.

Usage: trace_summary.py TRACE.json [--steps N] [--top K] [--gaps K] [--host] [--bubble]
"""
import argparse
import collections
import json
import re
import sys

# First match wins; patterns are searched in the lower-cased kernel name.
CLASSES = [
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|sdpa|attention|cudnn::fusion"),  # cudnn::fusion: SDPA backward helpers
    ("layer_norm", r"layer_?norm|gammabeta|rmsnorm"),
    ("conv", r"conv(?!ert)|fprop|dgrad|wgrad|winograd"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|matmul|sm90_"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("batch_norm", r"batch_norm|bn_fw|bn_bw|welford"),
    ("copy/cat", r"catarray|copy|memcpy|memset|transpose|permute"),
    ("reduction", r"reduce|softmax|cross_entropy|nll_loss|sum_kernel"),
    ("elementwise", r"elementwise|vectorized|unrolled|gelu|add_kernel|mul_kernel|fill"),
]


def classify(name):
    n = name.lower()
    for cls, pat in CLASSES:
        if re.search(pat, n):
            return cls
    return "other"


def idle_gaps(kernels):
    """(span_us, busy_us, gaps) of kernel events; gaps: [(idle_us, gap start, the kernel event
    after it)], longest first. Busy is the union of the kernels' intervals over all streams."""
    spans = sorted(kernels, key=lambda e: e["ts"])
    busy, gaps = 0.0, []
    start, end = spans[0]["ts"], spans[0]["ts"] + spans[0]["dur"]
    for k in spans[1:]:
        if k["ts"] > end:
            busy += end - start
            gaps.append((k["ts"] - end, end, k))
            start = k["ts"]
        end = max(end, k["ts"] + k["dur"])
    busy += end - start
    gaps.sort(key=lambda g: -g[0])
    return max(k["ts"] + k["dur"] for k in spans) - spans[0]["ts"], busy, gaps


def union_us(kernels):
    """Microseconds covered by at least one of the kernels' intervals."""
    total, end = 0.0, None
    for k in sorted(kernels, key=lambda e: e["ts"]):
        a, b = k["ts"], k["ts"] + k["dur"]
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def correlation(e):
    return (e.get("args") or {}).get("correlation")


def launches(events):
    """Host launch calls (CUDA runtime/driver events) by correlation id."""
    out = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and correlation(e) is not None:
            out[correlation(e)] = e
    return out


def percentile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def print_host(events, kernels, gaps, k):
    launch = launches(events)
    leads = [e["ts"] - launch[correlation(e)]["ts"] for e in kernels if correlation(e) in launch]
    if not leads:
        print("\nhost: the trace has no launch calls with correlation ids")
        return
    short = sum(1 for x in leads if x < 50)
    print(f"\nhost lead (kernel start - launch call), {len(leads)} kernels: p10 {percentile(leads, 0.1):.0f} us, "
          f"median {percentile(leads, 0.5):.0f} us; {100 * short / len(leads):.1f}% started < 50 us after launch")
    ops = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    for us, gap_start, after in gaps[:k]:
        call = launch.get(correlation(after))
        if call is None:
            print(f"gap {us:8.0f} us before {after['name'][:60]}: no launch call in the trace")
            continue
        # Ops of the launching thread covering at least a quarter of [gap start, launch call),
        # innermost (shortest) first: their parents follow.
        window = max(1e-9, call["ts"] - gap_start)
        busy = []
        for o in ops:
            if o.get("tid") != call.get("tid"):
                continue
            overlap = min(o["ts"] + o["dur"], call["ts"]) - max(o["ts"], gap_start)
            if overlap >= 0.25 * window:
                busy.append((overlap, o))
        busy.sort(key=lambda x: x[1]["dur"])
        what = ", ".join(f"{o['name'][:50]} ({ov:.0f} of {o['dur']:.0f})" for ov, o in busy[:4]) or "no op"
        print(f"gap {us:8.0f} us before {after['name'][:60]}: launched {after['ts'] - call['ts']:.0f} us before it "
              f"started; host meanwhile: {what}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace holds (times are divided by it)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--gaps", type=int, default=0, metavar="K",
                    help="also print busy/idle GPU time per step and the K longest idle gaps")
    ap.add_argument("--host", action="store_true",
                    help="with --gaps: host launch lead per kernel and what the host did during each gap")
    ap.add_argument("--bubble", action="store_true",
                    help="also print the pipeline bubble: (span - non-NCCL kernel time) / non-NCCL kernel time")
    a = ap.parse_args()
    try:
        with open(a.trace) as f:
            events = json.load(f)["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"trace_summary: cannot read {a.trace}: {e}")
    steps = max(1, a.steps)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    if kernels:
        by_class, by_name = collections.Counter(), collections.Counter()
        for e in kernels:
            by_class[classify(e["name"])] += e["dur"]
            by_name[e["name"]] += e["dur"]
        total = sum(by_class.values())
        print(f"GPU kernel time per step: {total / 1000 / steps:.2f} ms ({len(kernels)} kernels, {steps} steps)")
        print(f"{'class':<14} {'ms/step':>9} {'share':>7}")
        for cls, us in by_class.most_common():
            print(f"{cls:<14} {us / 1000 / steps:9.2f} {100 * us / total:6.1f}%")
        print(f"\ntop {a.top} kernels (ms per step)")
        for name, us in by_name.most_common(a.top):
            print(f"{us / 1000 / steps:8.3f}  {classify(name):<12} {name[:110]}")
        if a.gaps > 0:
            span, busy, gaps = idle_gaps(kernels)
            print(f"\nspan {span / 1000 / steps:.2f} ms/step, busy (union over streams) {busy / 1000 / steps:.2f} "
                  f"ms/step, idle {(span - busy) / 1000 / steps:.2f} ms/step")
            for us, _, after in gaps[:a.gaps]:
                print(f"gap {us:8.0f} us before {after['name'][:100]}")
            if a.host:
                print_host(events, kernels, gaps, a.gaps)
        if a.bubble:
            span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
            compute = union_us([k for k in kernels if classify(k["name"]) != "nccl"])
            if compute <= 0:
                sys.exit(f"trace_summary: {a.trace} has no kernels but NCCL's: no bubble to measure")
            print(f"\npipeline: span {span / 1000 / steps:.2f} ms/step, compute (non-NCCL kernels, union over "
                  f"streams) {compute / 1000 / steps:.2f} ms/step")
            print(f"bubble {(span - compute) / compute:.4f}")
        return
    ops = collections.Counter()
    for e in events:
        if e.get("cat") == "cpu_op" and "dur" in e:
            ops[e["name"]] += e["dur"]
    if not ops:
        sys.exit(f"trace_summary: {a.trace} has neither GPU kernels nor host ops")
    print(f"no GPU kernels in the trace: top {a.top} host ops (inclusive ms per step)")
    for name, us in ops.most_common(a.top):
        print(f"{us / 1000 / steps:9.3f}  {name}")


if __name__ == "__main__":
    main()
