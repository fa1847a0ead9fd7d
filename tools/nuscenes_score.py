#!/usr/bin/env python3
"""Score nuScenes detection submission JSON against ground truth in the same format, with the
formulas of docs/data.md ("Metrics"): the files `parallax eval --dump-predictions FILE` writes
(FILE and FILE with `_gt` before the extension), or any pair in that format.

    python3 tools/nuscenes_score.py preds.json preds_gt.json [--json]

Prints mAP (over classes and the centre-distance thresholds 0.5, 1, 2, 4 m), the mAP at each
threshold, per-class AP, the true-positive errors ATE, ASE, AOE, AVE, AAE at 2 m (per class and
their NaN-skipping mean over classes, with nuscenes-devkit's exceptions by class name), the
nuScenes detection score NDS = (5 mAP + sum over the 5 errors of max(1 - err, 0)) / 10 and
NDS without AAE (/ 9). A ground-truth velocity NaN (written `NaN`) is unknown. Classes are
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


def velocity_of(b, default):
    """(vx, vy) of a box; `default` without one; NaN for an unknown (NaN or null) component."""
    v = b.get("velocity")
    if v is None or len(v) != 2:
        return default
    return tuple(math.nan if x is None else float(x) for x in v)


def yaw_of(q):
    w, x, y, z = q
    return math.atan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))


def load(path, gt):
    with open(path) as f:
        doc = json.load(f)
    results = doc["results"]
    boxes = []
    for token, items in results.items():
        for row, b in enumerate(items):
            boxes.append({"sample": token, "key": (0, int(token), "") if token.isdigit() else (1, 0, token),
                          "row": row, "cls": b["detection_name"], "xyz": b["translation"], "wlh": b["size"],
                          "yaw": yaw_of(b["rotation"]), "score": b.get("detection_score", -1.0),
                          "vel": velocity_of(b, (math.nan, math.nan) if gt else (0.0, 0.0))})
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


def cummean(x):
    """The devkit's cummean: NaN skipped, 0 before the first number, all NaN gives ones."""
    if all(math.isnan(v) for v in x):
        return [1.0] * len(x)
    out, s, n = [], 0.0, 0
    for v in x:
        if not math.isnan(v):
            s, n = s + v, n + 1
        out.append(s / n if n else 0.0)
    return out


def nanmean(v):
    v = [x for x in v if not math.isnan(x)]
    return sum(v) / len(v) if v else math.nan


def angle_diff(gt, pred, period):
    d = (gt - pred + period / 2) % period - period / 2
    return abs(d - 2 * math.pi if d > math.pi else d)


def tp_errors(matches, npos, cls):
    """The devkit's accumulate + calc_tp for ATE, ASE, AOE, AVE, AAE; 1 where there is no true
    positive; NaN for its exceptions (traffic_cone: AOE, AVE, AAE; barrier: AVE, AAE)."""
    exempt = {"traffic_cone": ("aoe", "ave", "aae"), "barrier": ("ave", "aae")}.get(cls, ())
    tps = [m for m in matches if m[0]]
    if npos == 0 or not tps:
        return {k: math.nan if k in exempt else 1.0 for k in ("ate", "ase", "aoe", "ave", "aae")}
    _, rec, conf = curves(matches, npos)
    conf_at = [interp(x, rec, conf, conf[0], 0.0) for x in recall_points()]
    nonzero = [i for i, c in enumerate(conf_at) if c != 0]
    max_recall_ind = nonzero[-1] if nonzero else -1
    first = round(100 * MIN_RECALL) + 1
    errs = {"ate": [], "ase": [], "aoe": [], "ave": [], "aae": []}
    period = math.pi if cls == "barrier" else 2 * math.pi
    for _, p, g, dist in tps:
        errs["ate"].append(dist)
        inter = 1.0
        for a, b in zip(g["wlh"], p["wlh"]):
            inter *= min(a, b)
        vol = lambda s: s[0] * s[1] * s[2]  # noqa: E731
        errs["ase"].append(1 - inter / (vol(g["wlh"]) + vol(p["wlh"]) - inter))
        errs["aoe"].append(angle_diff(g["yaw"], p["yaw"], period))
        errs["ave"].append(math.hypot(p["vel"][0] - g["vel"][0], p["vel"][1] - g["vel"][1]))
        errs["aae"].append(math.nan)  # no ground-truth attribute (data/detection_score.h)
    xp = [m[1]["score"] for m in reversed(tps)]
    out = {}
    for name, e in errs.items():
        fp = cummean(e)[::-1]
        if name in exempt:
            out[name] = math.nan
        elif max_recall_ind < first:
            out[name] = 1.0
        else:
            vals = [interp(conf_at[i], xp, fp, fp[0], fp[-1]) for i in range(first, max_recall_ind + 1)]
            out[name] = sum(vals) / len(vals)
    return out


def score(pred_path, gt_path):
    (preds, pred_classes), (gts, gt_classes) = load(pred_path, False), load(gt_path, True)
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
        res["tp"][c] = tp_errors(match(p, g, TP_THRESHOLD), len(g), c)
    res["map"] = total / (len(classes) * len(THRESHOLDS)) if classes else 0.0
    for k in ("ate", "ase", "aoe", "ave", "aae"):
        res[k] = nanmean([res["tp"][c][k] for c in classes])
    # The devkit's nd_score: max(1 - err, 0), a NaN mean scoring 0 (Python's max(0.0, nan)).
    scores = [0.0 if math.isnan(res[k]) else max(1.0 - res[k], 0.0) for k in ("ate", "ase", "aoe", "ave")]
    four = scores[0] + scores[1] + scores[2] + scores[3]
    aae = 0.0 if math.isnan(res["aae"]) else max(1.0 - res["aae"], 0.0)
    res["nds"] = (5 * res["map"] + (four + aae)) / 10
    res["nds_no_aae"] = (5 * res["map"] + four) / 9
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
        print(f"{c:12s} AP {r['ap'][c]:.6f}  ATE {e['ate']:.6f}  ASE {e['ase']:.6f}  AOE {e['aoe']:.6f}  "
              f"AVE {e['ave']:.6f}  AAE {e['aae']:.6f}")
    for k in ("ate", "ase", "aoe", "ave", "aae", "nds", "nds_no_aae"):
        print(f"{k.upper():4s} {r[k]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
