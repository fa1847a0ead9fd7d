#!/usr/bin/env python3
"""Score nuScenes detection submission JSON against ground truth in the same format, with the
formulas of docs/data.md ("Metrics"): the files `parallax eval --dump-predictions FILE` writes
(FILE and FILE with `_gt` before the extension), or any pair in that format.

    python3 tools/nuscenes_score.py preds.json preds_gt.json [--json]

Prints mAP (over classes and the centre-distance thresholds 0.5, 1, 2, 4 m), the mAP at each
threshold, per-class AP, the true-positive errors ATE, ASE, AOE at 2 m (per class and their mean
over classes) and NDS = (5 mAP + sum over ATE, ASE, AOE of (1 - min(1, err))) / 10. Classes are
those of meta.classes, else those named in either file. Pure Python (no numpy): numpy.interp is reimplemented with the same
semantics, so results match `parallax eval` up to the rounding of hypot and the yaw recovered from
the quaternion (docs/data.md).

Ordering, as parallax and the nuScenes devkit: predictions sorted by descending score, ties by
sample (numeric tokens by value, else the token text), then by position in the sample's list.
"""
import argparse
import bisect
import json
import math
import sys

THRESHOLDS = (0.5, 1.0, 2.0, 4.0)
TP_THRESHOLD = 2.0
MIN_RECALL = 0.1
MIN_PRECISION = 0.1
POINTS = 101


def interp(x, xp, fp, left, right):
    """numpy.interp for one x and a non-decreasing xp (the last xp equal to x wins)."""
    if x < xp[0]:
        return left
    if x > xp[-1]:
        return right
    j = bisect.bisect_right(xp, x) - 1
    if j + 1 == len(xp) or xp[j] == x:
        return fp[j]
    slope = (fp[j + 1] - fp[j]) / (xp[j + 1] - xp[j])
    return slope * (x - xp[j]) + fp[j]


def recall_points():
    return [1.0 if i == POINTS - 1 else i * 0.01 for i in range(POINTS)]


def yaw_of(q):
    w, x, y, z = q
    return math.atan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))


def load(path):
    with open(path) as f:
        doc = json.load(f)
    results = doc["results"]
    boxes = []
    for token, items in results.items():
        for row, b in enumerate(items):
            boxes.append({"sample": token, "key": (0, int(token), "") if token.isdigit() else (1, 0, token),
                          "row": row, "cls": b["detection_name"], "xyz": b["translation"], "wlh": b["size"],
                          "yaw": yaw_of(b["rotation"]), "score": b.get("detection_score", -1.0)})
    return boxes, doc.get("meta", {}).get("classes")


def match(preds, gts, threshold):
    """Greedy matching of one class: [(is_tp, pred, gt or None)] in score order."""
    by_sample = {}
    for g in gts:
        by_sample.setdefault(g["sample"], []).append(g)
    taken = {s: [False] * len(v) for s, v in by_sample.items()}
    order = sorted(preds, key=lambda p: (-p["score"], p["key"], p["row"]))
    out = []
    for p in order:
        best, best_i = math.inf, -1
        cands = by_sample.get(p["sample"], [])
        for i, g in enumerate(cands):
            if taken[p["sample"]][i]:
                continue
            d = math.hypot(g["xyz"][0] - p["xyz"][0], g["xyz"][1] - p["xyz"][1])
            if d < best:
                best, best_i = d, i
        if best < threshold:
            taken[p["sample"]][best_i] = True
            out.append((True, p, cands[best_i], best))
        else:
            out.append((False, p, None, None))
    return out


def curves(matches, npos):
    tp = fp = 0
    prec, rec, conf = [], [], []
    for is_tp, p, _, _ in matches:
        tp += is_tp
        fp += not is_tp
        prec.append(tp / (tp + fp))
        rec.append(tp / npos)
        conf.append(p["score"])
    return prec, rec, conf


def average_precision(matches, npos):
    if npos == 0 or not any(m[0] for m in matches):
        return 0.0
    prec, rec, _ = curves(matches, npos)
    p = [interp(x, rec, prec, prec[0], 0.0) for x in recall_points()]
    first = round(100 * MIN_RECALL) + 1
    return sum(max(v - MIN_PRECISION, 0.0) for v in p[first:]) / (POINTS - first) / (1 - MIN_PRECISION)


def tp_errors(matches, npos):
    """The devkit's accumulate + calc_tp for ATE, ASE, AOE; 1 where there is no true positive."""
    tps = [m for m in matches if m[0]]
    if npos == 0 or not tps:
        return {"ate": 1.0, "ase": 1.0, "aoe": 1.0}
    _, rec, conf = curves(matches, npos)
    conf_at = [interp(x, rec, conf, conf[0], 0.0) for x in recall_points()]
    nonzero = [i for i, c in enumerate(conf_at) if c != 0]
    max_recall_ind = nonzero[-1] if nonzero else -1
    first = round(100 * MIN_RECALL) + 1
    errs = {"ate": [], "ase": [], "aoe": []}
    for _, p, g, dist in tps:
        errs["ate"].append(dist)
        inter = 1.0
        for a, b in zip(g["wlh"], p["wlh"]):
            inter *= min(a, b)
        vol = lambda s: s[0] * s[1] * s[2]  # noqa: E731
        errs["ase"].append(1 - inter / (vol(g["wlh"]) + vol(p["wlh"]) - inter))
        d = (g["yaw"] - p["yaw"] + math.pi) % (2 * math.pi) - math.pi
        errs["aoe"].append(abs(d))
    xp = [m[1]["score"] for m in reversed(tps)]
    out = {}
    for name, e in errs.items():
        mean, s = [], 0.0
        for i, v in enumerate(e):
            s += v
            mean.append(s / (i + 1))
        fp = mean[::-1]
        if max_recall_ind < first:
            out[name] = 1.0
        else:
            vals = [interp(conf_at[i], xp, fp, fp[0], fp[-1]) for i in range(first, max_recall_ind + 1)]
            out[name] = sum(vals) / len(vals)
    return out


def score(pred_path, gt_path):
    (preds, pred_classes), (gts, gt_classes) = load(pred_path), load(gt_path)
    # The class list of meta.classes (parallax writes the dataset's box classes: a class absent
    # from the split still counts, with AP 0 and errors 1), else the classes named in the files.
    classes = pred_classes or gt_classes or sorted({b["cls"] for b in preds} | {b["cls"] for b in gts})
    res = {"ap": {}, "map_at": {t: 0.0 for t in THRESHOLDS}, "tp": {}}
    total = 0.0
    for c in classes:
        p = [b for b in preds if b["cls"] == c]
        g = [b for b in gts if b["cls"] == c]
        aps = [average_precision(match(p, g, t), len(g)) for t in THRESHOLDS]
        res["ap"][c] = sum(aps) / len(aps)
        for t, a in zip(THRESHOLDS, aps):
            res["map_at"][t] += a / len(classes)
        for a in aps:  # the order of parallax's sum, so that mAP is bitwise the same
            total += a
        res["tp"][c] = tp_errors(match(p, g, TP_THRESHOLD), len(g))
    res["map"] = total / (len(classes) * len(THRESHOLDS)) if classes else 0.0
    for k in ("ate", "ase", "aoe"):
        res[k] = sum(res["tp"][c][k] for c in classes) / len(classes) if classes else 1.0
    nds = 5 * res["map"]
    for k in ("ate", "ase", "aoe"):
        nds += 1 - min(1.0, res[k])
    res["nds"] = nds / 10
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pred", help="detections (nuScenes submission JSON)")
    ap.add_argument("gt", help="ground truth in the same format")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args()
    r = score(a.pred, a.gt)
    if a.json:
        r["map_at"] = {f"{t:g}": v for t, v in r["map_at"].items()}
        print(json.dumps(r, indent=1))
        return 0
    print(f"mAP  {r['map']:.6f}")
    for t, v in r["map_at"].items():
        print(f"mAP@{t:g}m  {v:.6f}")
    for c in r["ap"]:
        e = r["tp"][c]
        print(f"{c:12s} AP {r['ap'][c]:.6f}  ATE {e['ate']:.6f}  ASE {e['ase']:.6f}  AOE {e['aoe']:.6f}")
    print(f"ATE  {r['ate']:.6f}\nASE  {r['ase']:.6f}\nAOE  {r['aoe']:.6f}\nNDS  {r['nds']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
