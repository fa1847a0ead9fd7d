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
  2. runs the model in ONNX Runtime on the CPU, the frames fed in batches of "ort_batch" (read from
     parity.h5 batch by batch, so memory holds one batch whatever the number of frames);
  3. compares every output of every frame with LibTorch: max |onnx - torch|, that over max |torch|
     (max-rel), and the cosine similarity of the flattened tensors;
  4. applies the gate (per output and frame: cosine >= min_cosine and
     max_abs <= max_abs_rel * max(1, max |torch|)), writes parity.json with every number, and prints
     one summary line last.

A quantized (QAT) model's parity.h5 also holds its rounding ties (config "ties": the margin and
the graph tensors; groups "ties/<k>" with the per-frame "count", the flat "index" and "level" of
every element whose quotient x / scale lay within the margin of a rounding boundary in LibTorch's
forward, and the tensor's per-frame "shape"): the tool then runs a copy of the model in which each
of those QuantizeLinear outputs takes LibTorch's level at those elements (a Where after it) and
its own everywhere else, reports how many of them ONNX Runtime had rounded the other way, and
gates that run (docs/export.md "QAT models": without it, the one-step differences spread through
the following quantized layers).

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


OWN = "__parity_own"        # a QuantizeLinear output as ONNX Runtime computed it
TIE_MASK = "__parity_tie_mask_"
TIE_LEVEL = "__parity_tie_level_"


def with_ties(path, tensors):
    """A copy of the model (beside it, sharing its external data) in which QuantizeLinear output
    `tensors[k]` becomes Where(TIE_MASK<k>, TIE_LEVEL<k>, own), own (renamed <name>OWN) also an
    output. Returns the copy's path."""
    import onnx
    from onnx import TensorProto, helper
    model = onnx.load(path, load_external_data=False)
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    nodes = []
    for k, t in enumerate(tensors):
        q = producer.get(t)
        if q is None or q.op_type != "QuantizeLinear":
            fail_tool(f"the ties name '{t}', which is no QuantizeLinear output of the model")
        q.output[0] = t + OWN
        g.input.append(helper.make_tensor_value_info(TIE_MASK + str(k), TensorProto.BOOL, None))
        g.input.append(helper.make_tensor_value_info(TIE_LEVEL + str(k), TensorProto.INT32, None))
        g.output.append(helper.make_tensor_value_info(t + OWN, TensorProto.INT8, None))
        # The Where runs on int32: the GPU image's ONNX Runtime has no int8 kernel for the CPU Where
        # ('Could not find an implementation for Where(16)'); int8 -> int32 -> int8 is exact.
        nodes.append((q, [helper.make_node("Cast", [t + OWN], [t + OWN + "_i32"], to=TensorProto.INT32,
                                           name=t + "/parity_own_i32"),
                          helper.make_node("Where", [TIE_MASK + str(k), TIE_LEVEL + str(k), t + OWN + "_i32"],
                                           [t + "_tied_i32"], name=t + "/parity_tie"),
                          helper.make_node("Cast", [t + "_tied_i32"], [t], to=TensorProto.INT8,
                                           name=t + "/parity_tied_i8")]))
    # Each Where right after its QuantizeLinear (the node list stays topologically sorted).
    for q, added in nodes:
        at = list(g.node).index(q) + 1
        for j, n in enumerate(added):
            g.node.insert(at + j, n)
    out = os.path.join(os.path.dirname(os.path.abspath(path)), ".parity-ties-" + os.path.basename(path))
    onnx.save(model, out)
    return out


def tie_feed(f, tie_info, start, count, feed, stats):
    """The mask and levels of frames start .. start + count - 1 for every tied tensor, in the batch's
    layout: the frames' tensors one after another (the batch, or cameras x batch, is outermost)."""
    import numpy as np
    for k, t in enumerate(tie_info):
        shape = t["shape"]
        per = int(np.prod(shape))
        mask = np.zeros(per * count, dtype=bool)
        level = np.zeros(per * count, dtype=np.int32)
        g = f["ties"][str(k)]
        off = t["offsets"]
        lo, hi = int(off[start]), int(off[start + count])
        idx = g["index"][lo:hi].astype(np.int64)
        lev = g["level"][lo:hi]
        for j in range(count):
            a, b = int(off[start + j]) - lo, int(off[start + j + 1]) - lo
            mask[j * per + idx[a:b]] = True
            level[j * per + idx[a:b]] = lev[a:b]
        batch_shape = [shape[0] * count, *shape[1:]]
        feed[TIE_MASK + str(k)] = mask.reshape(batch_shape)
        feed[TIE_LEVEL + str(k)] = level.reshape(batch_shape)
        stats["elements"] += per * count
        stats["ties"] += hi - lo


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

    f = h5py.File(args.frames, "r")
    cfg = json.loads(f.attrs["config"])
    frames = int(cfg["frames"])
    gate = cfg["gate"]
    shapes = check_file(args.model, cfg["outputs"])

    ties = cfg.get("ties")
    model_path = args.model
    if ties:
        model_path = with_ties(args.model, ties["tensors"])
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        sess = ort.InferenceSession(model_path, sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001
        fail_tool(f"ONNX Runtime cannot load {args.model}: {e}")
    finally:
        if model_path != args.model:
            os.remove(model_path)
    names = [o.name for o in sess.get_outputs()]
    # With ties, the model as written also runs, free (its own rounding at every tie): reported in
    # parity.json as "free_running", not gated (docs/export.md "QAT models" says why).
    free_sess = None
    free = None
    if ties:
        try:
            free_sess = ort.InferenceSession(args.model, sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001
            fail_tool(f"ONNX Runtime cannot load {args.model}: {e}")
        free = {n: {"min_cosine": 1.0, "max_abs": 0.0} for n in cfg["outputs"]}
    tie_info = None
    if ties:
        tie_info = []
        for k, t in enumerate(ties["tensors"]):
            g = f["ties"][str(k)]
            counts = g["count"][()].astype(np.int64)
            tie_info.append({"name": t, "shape": [int(v) for v in g["shape"][()]],
                             "offsets": np.concatenate([[0], np.cumsum(counts)])})
        tie_stats = {"margin": ties["margin"], "tensors": len(tie_info), "elements": 0, "ties": 0,
                     "ort_rounded_otherwise": 0}
    missing = [n for n in cfg["outputs"] if n not in names]
    if missing:
        fail_tool(f"ONNX Runtime gives no output(s) {missing}")
    batch = int(cfg["ort_batch"])
    run_s = 0.0
    report = {
        "model": os.path.basename(args.model),
        "opset": cfg["opset"], "dtype": cfg["dtype"], "batch": cfg["batch"], "ort_batch": batch,
        "frames": frames, "frames_source": cfg["frames_source"], "reference": cfg["reference"],
        "onnx": onnx.__version__, "onnxruntime": ort.__version__, "provider": "CPUExecutionProvider",
        "checker": {"full_check": True, "passed": True},
        "shape_inference": {"strict": True, "outputs": shapes},
        "gate": gate,
        "ort_ms_per_frame": 0.0,
        "outputs": {},
        "failures": [],
    }
    per_output = {n: [] for n in cfg["outputs"]}
    for start in range(0, frames, batch):
        feed = {n: f["inputs"][n][start:start + batch] for n in cfg["inputs"]}
        if tie_info:
            tie_feed(f, tie_info, start, min(batch, frames - start), feed, tie_stats)
        t0 = time.perf_counter()
        try:
            res = dict(zip(names, sess.run(names, feed)))
        except Exception as e:  # noqa: BLE001
            fail_tool(f"ONNX Runtime fails on frames {start}..{start + batch - 1}: {e}")
        run_s += time.perf_counter() - t0
        if tie_info:
            for k, t in enumerate(tie_info):
                own = res[t["name"] + OWN].reshape(-1)
                mask, lev = feed[TIE_MASK + str(k)].reshape(-1), feed[TIE_LEVEL + str(k)].reshape(-1)
                tie_stats["ort_rounded_otherwise"] += int((own[mask] != lev[mask]).sum())
        if free_sess is not None:
            try:
                free_res = dict(zip(cfg["outputs"], free_sess.run(cfg["outputs"],
                                                                    {n: feed[n] for n in cfg["inputs"]})))
            except Exception as e:  # noqa: BLE001
                fail_tool(f"ONNX Runtime fails on frames {start}..{start + batch - 1} (model as written): {e}")
            for n in cfg["outputs"]:
                ref = f["outputs"][n][start:start + batch].astype(np.float32)
                for j in range(ref.shape[0]):
                    a = free_res[n][j].astype(np.float32)
                    fin = bool(np.isfinite(a).all())
                    free[n]["min_cosine"] = min(free[n]["min_cosine"], cosine(a, ref[j]) if fin else float("nan"))
                    d = float(np.abs(a.astype(np.float64) - ref[j].astype(np.float64)).max()) if fin else float("inf")
                    free[n]["max_abs"] = max(free[n]["max_abs"], d)
        for n in cfg["outputs"]:
            onnx_out = res[n].astype(np.float32)
            ref = f["outputs"][n][start:start + batch].astype(np.float32)
            if onnx_out.shape != ref.shape:
                fail_tool(f"output '{n}': ONNX Runtime gives shape {list(onnx_out.shape)} for frames "
                          f"{start}.., LibTorch {list(ref.shape)}")
            for j in range(ref.shape[0]):
                i = start + j
                a, b = onnx_out[j], ref[j]
                d = np.abs(a.astype(np.float64) - b.astype(np.float64))
                finite = bool(np.isfinite(a).all())
                ref_max = float(np.abs(b).max()) if b.size else 0.0
                max_abs = float(d.max()) if finite and d.size else float("inf")
                bound = gate["max_abs_rel"] * max(1.0, ref_max)
                cos = cosine(a, b) if finite else float("nan")
                ok = finite and cos >= gate["min_cosine"] and max_abs <= bound
                per_output[n].append({"max_abs": max_abs,
                                      "max_rel": max_abs / ref_max if ref_max > 0 else max_abs,
                                      "cosine": cos, "ref_max_abs": ref_max, "max_abs_bound": bound,
                                      "finite": finite, "pass": ok})
                if not ok:
                    why = []
                    if not finite:
                        why.append("non-finite values")
                    if not cos >= gate["min_cosine"]:
                        why.append(f"cosine {cos:.6f} < {gate['min_cosine']}")
                    if not max_abs <= bound:
                        why.append(f"max_abs {max_abs:.3g} > {bound:.3g} ({gate['max_abs_rel']} x max(1, "
                                   f"max|torch| {ref_max:.3g}))")
                    report["failures"].append(f"output '{n}' frame {i}: " + ", ".join(why))
    ref_shapes = {n: list(f["outputs"][n].shape[1:]) for n in cfg["outputs"]}
    f.close()
    report["ort_ms_per_frame"] = 1000.0 * run_s / max(frames, 1)
    if tie_info:
        report["ties"] = tie_stats
        report["free_running"] = {"gated": False, "outputs": free}
    for n in cfg["outputs"]:
        per_frame = per_output[n]
        worst = lambda key, pick: max(range(frames), key=lambda i: pick(per_frame[i][key]))  # noqa: E731
        i_abs = worst("max_abs", lambda v: v)
        i_rel = worst("max_rel", lambda v: v)
        i_cos = worst("cosine", lambda v: -v if v == v else float("inf"))
        report["outputs"][n] = {
            "shape": ref_shapes[n],
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
    if free:
        parts.append("model as written, not gated: " + ", ".join(
            f"{n} cos {o['min_cosine']:.7f}" for n, o in free.items()))
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
