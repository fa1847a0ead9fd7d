#!/usr/bin/env python3
"""The ONNX Runtime side of `parallax export`'s parity gate (docs/export.md).

    onnx_parity.py --model model.onnx --frames parity.h5 --out parity.json

parity.h5 (written by checkpoint/export/onnx_export.cpp) holds the graph inputs of every frame
("inputs/<name>", [F, ...]), LibTorch's outputs ("outputs/<name>", float32 [F, ...]) and, in the
file attribute "config" (JSON), the gate, the batch ONNX Runtime is fed and where the frames came
from. This tool

  1. checks the file with onnx.checker.check_model(full_check=True) (by path, so external data is
     resolved) and with strict shape inference, which must give every graph output its full shape
     (each dimension a size, or the symbolic batch axis);
  2. runs the model in ONNX Runtime on the CPU, the frames fed in batches of "ort_batch";
  3. compares every output of every frame with LibTorch: max |onnx - torch|, that over max |torch|
     (max-rel), and the cosine similarity of the flattened tensors;
  4. applies the gate (per output and frame: cosine >= min_cosine and
     max_abs <= max_abs_rel * max(1, max |torch|)), writes parity.json with every number, and prints
     one summary line last.

Exit status: 0 the gate passed; 1 the gate failed (the last line names the output, frame and
numbers); 2 the file or the tool failed (checker, shape inference, ONNX Runtime, bad arguments).
"""
import argparse
import json
import os
import sys
import time
import traceback


def fail_tool(msg):
    print(f"onnx_parity: error: {msg}")
    sys.exit(2)


def cosine(a, b):
    import numpy as np
    a = a.astype(np.float64).ravel()
    b = b.astype(np.float64).ravel()
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(np.dot(a, b) / (na * nb))


def check_file(path, outputs):
    """Full checker and strict shape inference; returns {output: [dims]}."""
    import onnx
    try:
        onnx.checker.check_model(path, full_check=True)
    except Exception as e:  # noqa: BLE001 - report whatever the checker raises
        fail_tool(f"onnx.checker.check_model(full_check=True) rejects {path}: {e}")
    model = onnx.load(path, load_external_data=False)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:  # noqa: BLE001
        fail_tool(f"strict shape inference fails on {path}: {e}")
    shapes = {}
    for o in inferred.graph.output:
        t = o.type.tensor_type
        if not t.HasField("shape"):
            fail_tool(f"shape inference gives output '{o.name}' no shape")
        dims = []
        for d in t.shape.dim:
            if d.HasField("dim_value"):
                dims.append(d.dim_value)
            elif d.HasField("dim_param") and d.dim_param:
                dims.append(d.dim_param)
            else:
                fail_tool(f"shape inference leaves a dimension of output '{o.name}' unknown")
        shapes[o.name] = dims
    missing = [n for n in outputs if n not in shapes]
    if missing:
        fail_tool(f"the model has no output(s) {missing}")
    return shapes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--frames", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import h5py
    import numpy as np
    import onnx
    import onnxruntime as ort

    with h5py.File(args.frames, "r") as f:
        cfg = json.loads(f.attrs["config"])
        inputs = {n: f["inputs"][n][()] for n in cfg["inputs"]}
        refs = {n: f["outputs"][n][()] for n in cfg["outputs"]}
    frames = int(cfg["frames"])
    gate = cfg["gate"]
    shapes = check_file(args.model, cfg["outputs"])

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        sess = ort.InferenceSession(args.model, sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001
        fail_tool(f"ONNX Runtime cannot load {args.model}: {e}")
    names = [o.name for o in sess.get_outputs()]
    got = {n: [] for n in names}
    batch = int(cfg["ort_batch"])
    run_s = 0.0
    for start in range(0, frames, batch):
        feed = {n: v[start:start + batch] for n, v in inputs.items()}
        t0 = time.perf_counter()
        try:
            res = sess.run(names, feed)
        except Exception as e:  # noqa: BLE001
            fail_tool(f"ONNX Runtime fails on frames {start}..{start + batch - 1}: {e}")
        run_s += time.perf_counter() - t0
        for n, r in zip(names, res):
            got[n].append(r)

    report = {
        "model": os.path.basename(args.model),
        "opset": cfg["opset"], "dtype": cfg["dtype"], "batch": cfg["batch"], "ort_batch": batch,
        "frames": frames, "frames_source": cfg["frames_source"], "reference": cfg["reference"],
        "onnx": onnx.__version__, "onnxruntime": ort.__version__, "provider": "CPUExecutionProvider",
        "checker": {"full_check": True, "passed": True},
        "shape_inference": {"strict": True, "outputs": shapes},
        "gate": gate,
        "ort_ms_per_frame": 1000.0 * run_s / max(frames, 1),
        "outputs": {},
        "failures": [],
    }
    for n in cfg["outputs"]:
        onnx_out = np.concatenate(got[n], 0).astype(np.float32)
        ref = refs[n].astype(np.float32)
        if onnx_out.shape != ref.shape:
            fail_tool(f"output '{n}': ONNX Runtime gives shape {list(onnx_out.shape)}, LibTorch {list(ref.shape)}")
        per_frame = []
        for i in range(frames):
            a, b = onnx_out[i], ref[i]
            d = np.abs(a.astype(np.float64) - b.astype(np.float64))
            finite = bool(np.isfinite(a).all())
            ref_max = float(np.abs(b).max()) if b.size else 0.0
            max_abs = float(d.max()) if finite and d.size else float("inf")
            bound = gate["max_abs_rel"] * max(1.0, ref_max)
            cos = cosine(a, b) if finite else float("nan")
            ok = finite and cos >= gate["min_cosine"] and max_abs <= bound
            per_frame.append({"max_abs": max_abs, "max_rel": max_abs / ref_max if ref_max > 0 else max_abs,
                              "cosine": cos, "ref_max_abs": ref_max, "max_abs_bound": bound,
                              "finite": finite, "pass": ok})
            if not ok:
                why = []
                if not finite:
                    why.append("non-finite values")
                if not cos >= gate["min_cosine"]:
                    why.append(f"cosine {cos:.6f} < {gate['min_cosine']}")
                if not max_abs <= bound:
                    why.append(f"max_abs {max_abs:.3g} > {bound:.3g} ({gate['max_abs_rel']} x max(1, max|torch| {ref_max:.3g}))")
                report["failures"].append(f"output '{n}' frame {i}: " + ", ".join(why))
        worst = lambda key, pick: max(range(frames), key=lambda i: pick(per_frame[i][key]))  # noqa: E731
        i_abs = worst("max_abs", lambda v: v)
        i_rel = worst("max_rel", lambda v: v)
        i_cos = worst("cosine", lambda v: -v if v == v else float("inf"))
        report["outputs"][n] = {
            "shape": list(ref.shape[1:]),
            "max_abs": per_frame[i_abs]["max_abs"], "max_abs_frame": i_abs,
            "max_rel": per_frame[i_rel]["max_rel"], "max_rel_frame": i_rel,
            "min_cosine": per_frame[i_cos]["cosine"], "min_cosine_frame": i_cos,
            "pass": all(p["pass"] for p in per_frame),
            "per_frame": per_frame,
        }
    report["verdict"] = "pass" if not report["failures"] else "fail"
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    parts = [f"{n} cos {o['min_cosine']:.7f} max_abs {o['max_abs']:.2e} max_rel {o['max_rel']:.2e}"
             for n, o in report["outputs"].items()]
    if report["failures"]:
        extra = f" (+{len(report['failures']) - 1} more)" if len(report["failures"]) > 1 else ""
        print(f"FAIL: {report['failures'][0]}{extra}")
        sys.exit(1)
    print(f"PASS ({cfg['dtype']}, gate cosine >= {gate['min_cosine']}, max_abs <= {gate['max_abs_rel']} x "
          f"max(1, max|torch|)): " + "; ".join(parts))
    sys.exit(0)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except Exception:  # noqa: BLE001 - the caller reports our last line
        traceback.print_exc()
        fail_tool("unexpected failure (traceback above)")
