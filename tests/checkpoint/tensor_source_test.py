#!/usr/bin/env python3
"""Foreign tensor files made by the real Python libraries, read by checkpoint/tensor_source.h
through tensor_source_tool: safetensors.torch.save_file (every dtype, empty and scalar shapes,
metadata; a sharded set with its index) and torch.save (a model's state_dict, a nested dict with
an epoch, bf16 / fp16 / int64 / float8, views sharing one storage, lists, Parameters, protocol 4)
read bitwise; a C++-written file read bitwise by safetensors.torch.load_file; and refusals, each
naming the file: a pickle whose __reduce__ calls os.system (the command must not run), a truncated
zip, the legacy format, a file without tensors.

usage: tensor_source_test.py TENSOR_SOURCE_TOOL
"""
import collections
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

TOOL = sys.argv[1]
DTYPE = {torch.float64: "Double", torch.float32: "Float", torch.float16: "Half",
         torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int", torch.int16: "Short",
         torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
         torch.float8_e4m3fn: "Float8_e4m3fn", torch.float8_e5m2: "Float8_e5m2"}
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def raw(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def fresh(dtype, shape, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -2**40), min(info.max, 2**40), shape, generator=gen,
                         dtype=torch.int64).to(dtype)


def tool(verb, src, out):
    return subprocess.run([TOOL, verb, src, out], capture_output=True, text=True, timeout=60)


def dump(path, expected, tmp, label, skipped=0, metadata=None, fmt=None):
    """Reads `path` with the C++ reader and compares every tensor bitwise with `expected`."""
    out = tempfile.mkdtemp(dir=tmp)
    r = tool("dump", path, out)
    check(r.returncode == 0, f"{label}: dump failed: {r.stdout}{r.stderr}")
    if r.returncode != 0:
        return
    m = json.load(open(os.path.join(out, "manifest.json")))
    names = [t["name"] for t in m["tensors"]]
    check(names == sorted(expected), f"{label}: names {names} != {sorted(expected)}")
    check(m["skipped"] == skipped, f"{label}: skipped {m['skipped']} != {skipped}")
    if metadata is not None:
        check(m["metadata"] == metadata, f"{label}: metadata {m['metadata']} != {metadata}")
    if fmt is not None:
        check(m["format"] == fmt, f"{label}: format {m['format']}")
    for t in m["tensors"]:
        e = expected.get(t["name"])
        if e is None:
            continue
        check(t["dtype"] == DTYPE[e.dtype], f"{label}: {t['name']} dtype {t['dtype']} vs {e.dtype}")
        check(t["shape"] == list(e.shape), f"{label}: {t['name']} shape {t['shape']} vs {list(e.shape)}")
        check(open(t["file"], "rb").read() == raw(e), f"{label}: {t['name']} bytes differ")


def refused(path, label, *parts, code=3):
    r = tool("dump", path, tempfile.mkdtemp())
    check(r.returncode == code, f"{label}: exit {r.returncode}, want {code}: {r.stdout}{r.stderr}")
    for p in (path,) + parts:
        check(p in r.stdout, f"{label}: message lacks '{p}': {r.stdout}")


class Pwn:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def main():
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    with tempfile.TemporaryDirectory() as tmp:
        # ---- safetensors written by Python ----
        st = {f"t_{DTYPE[d]}": fresh(d, (3, 5), gen) for d in DTYPE}
        st["empty"] = torch.empty(0, 4)
        st["scalar"] = fresh(torch.float32, (), gen)
        f = os.path.join(tmp, "py.safetensors")
        save_file(st, f, metadata={"format": "pt", "note": "ünïcode"})
        dump(f, st, tmp, "safetensors from Python", metadata={"format": "pt", "note": "ünïcode"},
             fmt="safetensors")
        # ---- ... copied by C++ (write_safetensors), read by Python ----
        c = os.path.join(tmp, "cpp.safetensors")
        r = tool("copy", f, c)
        check(r.returncode == 0, f"copy failed: {r.stdout}{r.stderr}")
        back = load_file(c)
        check(sorted(back) == sorted(st), "C++ file: names differ")
        for k, v in st.items():
            check(back[k].dtype == v.dtype and back[k].shape == v.shape and raw(back[k]) == raw(v),
                  f"C++ file: {k} differs in Python")
        with safe_open(c, "pt") as h:
            check(h.metadata() == {"format": "pt", "note": "ünïcode"}, f"C++ file: metadata {h.metadata()}")
        # ---- a sharded set (Hugging Face layout) ----
        d = os.path.join(tmp, "hf")
        os.makedirs(d)
        s1 = {"a": fresh(torch.float32, (4, 4), gen), "c": fresh(torch.int64, (3,), gen)}
        s2 = {"b": fresh(torch.bfloat16, (2, 6), gen)}
        save_file(s1, os.path.join(d, "model-00001-of-00002.safetensors"))
        save_file(s2, os.path.join(d, "model-00002-of-00002.safetensors"))
        wm = {k: "model-00001-of-00002.safetensors" for k in s1}
        wm.update({k: "model-00002-of-00002.safetensors" for k in s2})
        json.dump({"metadata": {"total_size": 100}, "weight_map": wm},
                  open(os.path.join(d, "model.safetensors.index.json"), "w"))
        dump(d, {**s1, **s2}, tmp, "sharded set", metadata={"total_size": "100"})

        # ---- torch.save ----
        model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4))
        sd = model.state_dict()
        p = os.path.join(tmp, "sd.pt")
        torch.save(sd, p)
        dump(p, dict(sd), tmp, "state_dict", fmt="torch.save")

        base = fresh(torch.float32, (6, 8), gen)
        inner = collections.OrderedDict(
            w=base, slice=base[1:3, 2:5], t=base.t(), every_other=base[::2, 1::3],
            bf16=fresh(torch.bfloat16, (7,), gen), fp16=fresh(torch.float16, (2, 3), gen),
            i64=fresh(torch.int64, (5,), gen), f8=fresh(torch.float8_e4m3fn, (4,), gen),
            param=torch.nn.Parameter(fresh(torch.float32, (3,), gen)))
        nested = {"state_dict": inner, "epoch": 3, "extra": [fresh(torch.int32, (2,), gen), "x", None],
                  "pair": (fresh(torch.bool, (4,), gen),)}
        expected = {f"state_dict.{k}": v for k, v in inner.items()}
        expected.update({"extra.0": nested["extra"][0], "pair.0": nested["pair"][0]})
        for proto in (2, 4):
            p = os.path.join(tmp, f"nested{proto}.pt")
            torch.save(nested, p, pickle_protocol=proto)
            dump(p, expected, tmp, f"nested dict, protocol {proto}", skipped=3)
        pt = os.path.join(tmp, "bare.pth")
        torch.save(base[2], pt)
        dump(pt, {"": base[2]}, tmp, "a bare tensor")

        # ---- refusals ----
        marker = os.path.join(tmp, "pwned")
        for proto in (2, 4):
            p = os.path.join(tmp, f"pwn{proto}.pt")
            torch.save({"w": torch.ones(2), "evil": Pwn(marker)}, p, pickle_protocol=proto)
            refused(p, f"os.system pickle, protocol {proto}", f"'{os.system.__module__}.system'",
                    "nothing was loaded")
            check(not os.path.exists(marker), "the hostile pickle ran its command")
        good = os.path.join(tmp, "nested2.pt")
        blob = open(good, "rb").read()
        for cut in (len(blob) - 10, len(blob) // 2, 100):
            p = os.path.join(tmp, f"cut{cut}.pt")
            open(p, "wb").write(blob[:cut])
            refused(p, f"torch.save cut to {cut} bytes")
        p = os.path.join(tmp, "legacy.pt")
        torch.save({"w": torch.ones(2)}, p, _use_new_zipfile_serialization=False)
        refused(p, "legacy format", "re-save")
        p = os.path.join(tmp, "notensor.pt")
        torch.save({"epoch": 3, "name": "x"}, p)
        refused(p, "no tensor", "holds no tensor")
        refused(os.path.join(tmp, "missing.pt"), "missing file", code=4)

    print(f"tensor_source_test: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
