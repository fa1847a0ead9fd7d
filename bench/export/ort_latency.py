#!/usr/bin/env python3
"""ONNX Runtime CPU latency per frame of an exported model (docs/PERFORMANCE.md, docs/export.md).

    ort_latency.py MODEL.onnx PARITY.h5 [--warmup 1] [--iters 5] [--threads 0]

Feeds the first frame of the export's parity.h5 (batch 1; a fixed-batch model gets its batch of
frames and the time is divided by it), runs `warmup` untimed and `iters` timed sessions, and prints
one JSON line: median / min ms per frame, the model's size, ONNX Runtime's version and threads.
"""
import argparse
import json
import os
import statistics
import time

import h5py
import onnxruntime as ort


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("frames")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT's default, all cores)")
    a = ap.parse_args()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = a.threads
    t0 = time.perf_counter()
    sess = ort.InferenceSession(a.model, sess_options=opts, providers=["CPUExecutionProvider"])
    load_s = time.perf_counter() - t0
    batch = sess.get_inputs()[0].shape[0]
    batch = batch if isinstance(batch, int) else 1
    with h5py.File(a.frames, "r") as f:
        feed = {i.name: f["inputs"][i.name][:batch] for i in sess.get_inputs()}
    for _ in range(a.warmup):
        sess.run(None, feed)
    times = []
    for _ in range(a.iters):
        t = time.perf_counter()
        sess.run(None, feed)
        times.append((time.perf_counter() - t) * 1000.0 / batch)
    data = a.model + ".data"
    size = os.path.getsize(a.model) + (os.path.getsize(data) if os.path.exists(data) else 0)
    print(json.dumps({"model": a.model, "bytes": size, "batch": batch, "onnxruntime": ort.__version__,
                      "threads": a.threads or os.cpu_count(), "session_load_s": round(load_s, 3),
                      "warmup": a.warmup, "iters": a.iters, "median_ms_per_frame": round(statistics.median(times), 2),
                      "min_ms_per_frame": round(min(times), 2)}))


if __name__ == "__main__":
    main()
