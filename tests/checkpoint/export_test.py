#!/usr/bin/env python3
"""`parallax export --format weights`: the weights.h5 it writes, read back with h5py, equals the saved
parameters exactly (fp32) or their bf16 rounding (bf16); the checkpoint it came from, assembled
from its shards by an independent h5py reader following metadata.json, agrees; `--format onnx`
is rejected with a clear error; a checkpoint holding NaN or inf (as an older Parallax could commit
it) fails `inspect` naming the tensors, and `export` refuses it unless --force (which warns).

usage: export_test.py PARALLAX CKPT_TOOL MPIRUN
"""
import json
import os
import random
import subprocess
import sys
import tempfile

import h5py
import numpy as np
import torch

NP_DTYPES = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "int32": np.int32,
             "uint8": np.uint8, "int8": np.int8, "bfloat16": np.uint16, "float16": np.uint16}

failures = []
passes = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    (passes if cond else failures).append(what)


def assemble(ckpt_dir, name):
    """The global tensor `name` of a checkpoint, from metadata.json and the rank files."""
    meta = json.load(open(os.path.join(ckpt_dir, "metadata.json")))
    t = meta["tensors"][name]
    out = np.zeros(t["shape"], dtype=NP_DTYPES[t["dtype"]])
    for s in t["shards"]:
        with h5py.File(os.path.join(ckpt_dir, s["file"]), "r") as f:
            box = tuple(slice(o, o + l) for o, l in zip(s["offsets"], s["lengths"]))
            out[box] = f[name][()]
    return out, t["dtype"]


def bf16_bits(x):
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def main():
    parallax, tool, mpirun = sys.argv[1:4]
    seed = random.SystemRandom().randrange(1, 1 << 40)
    with tempfile.TemporaryDirectory(prefix="parallax_export_") as tmp:
        run_dir = os.path.join(tmp, "runs", "demo")
        out = run([mpirun, "--oversubscribe", "--bind-to", "none", "-np", "2", tool, "make-model", run_dir, str(seed)])
        if out.returncode != 0:
            raise SystemExit(f"make-model failed: {out.stdout}{out.stderr}")
        ckpt = os.path.join(run_dir, "checkpoints", "step_00000003")
        ref_dir = os.path.join(run_dir, "reference")
        refs = {}
        for fn in sorted(os.listdir(ref_dir)):
            name = fn[:-4]
            refs[name] = np.fromfile(os.path.join(ref_dir, fn),
                                     dtype=np.int64 if name.endswith("num_batches_tracked") else np.float32)

        out = run([parallax, "export", "--run", run_dir, "--format", "weights"])
        check(out.returncode == 0, f"export fp32 exits 0 ({out.stderr.strip()})")
        path = os.path.join(run_dir, "export", "weights.h5")
        with h5py.File(path, "r") as f:
            check(f.attrs["format"] in (b"parallax-weights", "parallax-weights"), "format attribute")
            check(int(f.attrs["step"]) == 3, "step attribute")
            check(sorted(f.keys()) == sorted(refs.keys()),
                  f"one dataset per tensor, flat module names: {sorted(f.keys())}")
            for name, ref in refs.items():
                d = f[name]
                arr = d[()]
                if name.endswith("num_batches_tracked"):
                    check(arr.dtype == np.int64 and int(arr) == 123, f"{name}: int64 kept")
                    continue
                check(arr.dtype == np.float32, f"{name}: float32")
                check(np.array_equal(arr.reshape(-1), ref), f"{name}: equals the saved parameter (fp32, exact)")
                whole, dtype = assemble(ckpt, "model/" + name)
                check(np.array_equal(whole, arr), f"{name}: equals the checkpoint assembled from its shards")
            check(f["tp_proj.weight"].shape == (10, 6), "a tensor sharded over 2 ranks is exported whole")

        out = run([parallax, "export", "--run", run_dir, "--format", "weights", "--dtype", "bf16",
                   "--checkpoint", ckpt])
        check(out.returncode == 0, f"export bf16 exits 0 ({out.stderr.strip()})")
        with h5py.File(path, "r") as f:
            for name, ref in refs.items():
                d = f[name]
                if name.endswith("num_batches_tracked"):
                    continue
                dtype = d.attrs["dtype"]
                dtype = dtype.decode() if isinstance(dtype, bytes) else dtype
                check(dtype == "bfloat16" and d.dtype == np.uint16, f"{name}: bf16 stored as uint16 bits")
                check(np.array_equal(d[()].reshape(-1), bf16_bits(ref)), f"{name}: equals torch's bf16 rounding")

        # This run has a checkpoint but no config.yaml (ckpt_tool wrote it), so no model to build.
        out = run([parallax, "export", "--run", run_dir, "--format", "onnx"])
        check(out.returncode != 0 and "config.yaml" in out.stderr and "parallax: error:" in out.stderr,
              f"--format onnx without the run's config is rejected clearly: {out.stderr.strip()}")
        out = run([parallax, "export", "--run", os.path.join(tmp, "runs", "nope"), "--format", "weights"])
        check(out.returncode != 0 and "nope" in out.stderr, f"a missing run is an error: {out.stderr.strip()}")

        bad_dir = os.path.join(tmp, "runs", "diverged")
        out = run([tool, "make-model", bad_dir, str(seed), "nan"])
        if out.returncode != 0:
            raise SystemExit(f"make-model nan failed: {out.stdout}{out.stderr}")
        out = run([parallax, "inspect", bad_dir])
        check(out.returncode != 0 and "parallax: error:" in out.stderr and "head.weight" in out.stderr
              and "head.bias" in out.stderr, f"inspect fails naming the non-finite tensors: {out.stderr.strip()}")
        check("non-finite: model/head.weight: 1 NaN, 0 inf" in out.stdout and "NOT OK" in out.stdout,
              f"inspect lists them with a NOT OK verdict: {out.stdout[-400:]}")
        bad_out = os.path.join(bad_dir, "export", "weights.h5")
        out = run([parallax, "export", "--run", bad_dir, "--format", "weights"])
        check(out.returncode != 0 and "--force" in out.stderr and "model/head." in out.stderr
              and not os.path.exists(bad_out), f"export refuses non-finite weights: {out.stderr.strip()}")
        out = run([parallax, "export", "--run", bad_dir, "--format", "weights", "--force"])
        check(out.returncode == 0 and "WARN" in out.stderr and "head.weight" in out.stderr,
              f"export --force exports them with a warning: {out.stderr.strip()}")
        with h5py.File(bad_out, "r") as f:
            check(np.isnan(f["head.weight"][0, 0]) and np.isinf(f["head.bias"][1]),
                  "--force exports the values as they are")
    print(f"{len(passes)} passed, {len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
