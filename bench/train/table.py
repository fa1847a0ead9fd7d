#!/usr/bin/env python3
"""Markdown table of the JSON lines that bench/train/run_w1.sh and run_w2.sh print.

  python3 bench/train/table.py bench_gpu.jsonl
"""
import json
import sys

PEAK, CEILING = 989.0, 790.0  # TFLOP/s: dense bf16 datasheet, measured matmul ceiling


def main():
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
    print("| workload | GPUs | impl | batch/GPU | step ms | samples/s | TFLOP/s/GPU | MFU (989) | MFU (790) |"
          " peak GB | exposed comm / backward ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        comm = (f"{r['comm_exposed_ms']} / {r['backward_ms']}" if "backward_ms" in r else "-")
        print(f"| {r['workload']} | {r['gpus']} | {r['impl']} | {r['batch_per_gpu']} | {r['step_ms']} | "
              f"{r['img_per_s']} | {r['tflops_per_gpu']} | {r['tflops_per_gpu'] / PEAK:.3f} | "
              f"{r['tflops_per_gpu'] / CEILING:.3f} | {r.get('peak_mem_gb', '-')} | {comm} |")
    # Speed-ups of each Parallax row against the PyTorch rows of the same variant ("+bf16grads":
    # gradients all-reduced in bf16 on both sides), per workload and GPU count; scaling of each
    # multi-GPU Parallax row against the 1-GPU one.
    def variant(r):
        return r["impl"].partition("+")[2]

    def ours(r):
        return r["impl"].partition("+")[0] == "parallax"

    for w in sorted({r["workload"] for r in rows}):
        for g in sorted({r["gpus"] for r in rows if r["workload"] == w}):
            group = [r for r in rows if r["workload"] == w and r["gpus"] == g]
            for p in (r for r in group if ours(r)):
                for r in group:
                    if not ours(r) and variant(r) == variant(p):
                        print(f"- {w}, {g} GPU(s): {p['impl']} / {r['impl']} = {p['img_per_s'] / r['img_per_s']:.3f}")
        one = [r for r in rows if r["workload"] == w and r["gpus"] == 1 and r["impl"] == "parallax"]
        for r in rows:
            if one and r["workload"] == w and r["gpus"] > 1 and ours(r):
                eff = r["img_per_s"] / (r["gpus"] * one[0]["img_per_s"])
                print(f"- {w}: {r['impl']} scaling on {r['gpus']} GPUs = {100 * eff:.1f}% of {r['gpus']} x 1 GPU")

if __name__ == "__main__":
    main()
