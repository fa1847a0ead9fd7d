#!/usr/bin/env python3
"""mAVE, mAAE and the nuScenes detection score (issue 61) against nuscenes-devkit:

- a `datagen --layout nuscenes` folder, converted, bev_tiny trained 1 step, `eval
  --dump-predictions`: the ground-truth dump becomes a submission with known errors per box
  (centres moved up to 1.8 m, sizes scaled, yaws turned, velocities offset, scores spread so that
  the recall curves are not trivial, boxes dropped, false positives added);
- the devkit's DetectionEval scores it against the ground truth it reads from the nuScenes
  folder itself, and dumps the boxes it scored (after its own filtering): its ground truth with
  velocities, its predictions;
- Parallax's metrics on those same boxes (tests/data/nds_tool: DetectionApMetric,
  detection_tp_errors, add_detection_metrics, the code eval reports with) equal the devkit's:
  mAP, every class's AP and ATE, ASE, AOE, AVE (NaN for its exceptions, by class name), the means
  ATE ... AAE and NDS;
- the same with the folder's pedestrians and bicycles renamed barrier and traffic cone (in a copy
  of its category table): the devkit's class exceptions and barrier's orientation period pi on
  true positives;
- the dumps: every ground-truth velocity `eval` wrote is the devkit's (or NaN, written `NaN`),
  predictions' velocities are (0, 0) without a velocity head.

The ground truth's velocities: the devkit estimates them from prev/next annotations. The
generated folder's annotations have none linked (each sample's objects are their own instances),
so the devkit's are all NaN there; the devkit script then gives two of every three ground-truth
boxes a known velocity (a smooth function of the position) before it evaluates, so that AVE is a
real number with NaN (unknown) ground truth mixed in, as in real nuScenes. Boxes whose folder
velocity is finite (a layout with linked annotations) keep it.

Tolerance: both sides read the same float64 numbers (the devkit's boxes, written with repr and
read back by strtod: exact); the boxes' float32 storage in Parallax's shards decides only which
boxes exist, not the comparison. What differs is rounding: numpy.linalg.norm against hypot (one
ulp of a distance) and numpy's pairwise sums against sequential ones (at most n = 101 terms of
values <= 100, n u ~ 1e-14 relative). Through the interpolation (linear in the errors) and the
means (<= 101 points, then <= 10 classes) that stays below 1e-11 absolute; TOL = 1e-9 leaves
margin and is still far below any change a different match, NaN rule or exception makes
(>= 1e-4 here). NaN must be NaN on both sides.

Usage: test_nuscenes_nds.py <parallax> <nds_tool>
"""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

PARALLAX = NDS_TOOL = None
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SMALL = ["--height", "128", "--width", "224", "--threads", "2", "--seed", "11"]
DEVKIT_PY = os.environ.get("PARALLAX_NUSCENES_PYTHON", os.path.join(
    os.environ.get("PARALLAX_NUSCENES_VENV", os.path.expanduser("~/.cache/parallax/nuscenes-venv")), "bin", "python3"))
TOL = 1e-9
TP = {"trans_err": "ate", "scale_err": "ase", "orient_err": "aoe", "vel_err": "ave", "attr_err": "aae"}

# The devkit's side: evaluate, and dump its boxes as nds_tool rows. The known ground-truth
# velocity of a box is velocity_of(translation) (also used to build the submission).
DEVKIT_SCRIPT = r"""
import json, math, sys
import numpy as np
import nuscenes.eval.common.loaders as loaders
from nuscenes.nuscenes import NuScenes
from nuscenes.eval.common.config import config_factory
from nuscenes.eval.common.utils import quaternion_yaw
from nuscenes.eval.detection.evaluate import DetectionEval
from pyquaternion import Quaternion
root, submission, val, out_dir, rows_path = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], sys.argv[5]
exec(sys.argv[6])  # velocity_of
loaders.create_splits_scenes = lambda verbose=False: {"mini_val": val, "mini_train": []}
nusc = NuScenes(version="v1.0-mini", dataroot=root, verbose=False)
cfg = config_factory("detection_cvpr_2019")
ev = DetectionEval(nusc, cfg, submission, "mini_val", out_dir, verbose=False)
folder_velocity, injected, k = {}, 0, 0
for token in ev.gt_boxes.sample_tokens:
    for b in ev.gt_boxes[token]:
        folder_velocity.setdefault(token, []).append([list(b.translation), list(b.velocity)])
        if np.any(np.isnan(b.velocity)) and k % 3 != 0:
            b.velocity = tuple(velocity_of(b.translation))
            injected += 1
        k += 1
metrics, _ = ev.evaluate()
tokens = sorted(ev.gt_boxes.sample_tokens)
ids = {t: i for i, t in enumerate(tokens)}
cls = {c: i for i, c in enumerate(cfg.class_names)}
def row(b):
    w, l, h = b.size
    return [ids[b.sample_token], cls[b.detection_name], *b.translation, l, w, h,
            quaternion_yaw(Quaternion(b.rotation))]
with open(rows_path, "w") as f:
    f.write("classes " + " ".join(cfg.class_names) + "\n")
    for t in tokens:
        for i, b in enumerate(ev.pred_boxes[t]):
            f.write("pred " + " ".join(repr(float(v)) for v in row(b) + [b.detection_score, i, *b.velocity]) + "\n")
        for b in ev.gt_boxes[t]:
            f.write("gt " + " ".join(repr(float(v)) for v in row(b) + list(b.velocity)) + "\n")
json.dump({"metrics": metrics.serialize(), "injected": injected, "gt": len(ev.gt_boxes.all),
           "pred": len(ev.pred_boxes.all), "folder_velocity": folder_velocity}, sys.stdout)
"""

# A smooth, position-dependent ground velocity (m/s), so that the submission's velocities can be
# written near it without knowing which boxes the devkit's side gives it to.
VELOCITY_OF = "velocity_of = lambda t: (3.0 * math.sin(t[0] / 7.0), 2.0 * math.cos(t[1] / 5.0))"
exec(VELOCITY_OF)


def run(*args, env=None):
    p = subprocess.run([PARALLAX, *args], capture_output=True, text=True, timeout=600, env=env)
    return p.returncode, p.stdout, p.stderr


def turn(q, angle):
    """The quaternion (w, x, y, z) `q` turned by `angle` about the global z axis."""
    c, s = math.cos(angle / 2), math.sin(angle / 2)
    w, x, y, z = q
    return [c * w - s * z, c * x - s * y, c * y + s * x, c * z + s * w]


def submission_with_known_errors(gt_doc, seed, rename=None):
    """The ground-truth dump as a submission: per box a centre offset (0 .. 1.8 m, any direction),
    sizes scaled by 0.7 .. 1.3, the yaw turned by N(0, 0.4) (and by pi more for half the barriers:
    the same box for their period pi), the velocity offset by N(0, 0.4) per component, a score in
    (0.05, 1) (distinct: the devkit's order of equal scores is not ours); about 15 % dropped, and
    false positives (copies 3 .. 8 m away, another class one in three). `rename` maps class
    names."""
    rng = np.random.default_rng(seed)
    rename = rename or {}
    classes = ["car", "pedestrian", "bicycle", "truck", "barrier", "traffic_cone"]
    sub = {"meta": gt_doc["meta"], "results": {}}
    for token, boxes in gt_doc["results"].items():
        out = []
        for b in boxes:
            v0 = b["velocity"] if all(math.isfinite(v) for v in b["velocity"]) else velocity_of(b["translation"])
            for fp in (False, True):
                if not fp and rng.random() < 0.15:
                    continue  # dropped: recall below 1
                if fp and rng.random() > 0.3:
                    continue
                r, a = (rng.uniform(3, 8) if fp else rng.uniform(0, 1.8)), rng.uniform(-math.pi, math.pi)
                t = [b["translation"][0] + r * math.cos(a), b["translation"][1] + r * math.sin(a), b["translation"][2]]
                name = rename.get(b["detection_name"], b["detection_name"])
                name = name if not fp or rng.random() > 1 / 3 else str(rng.choice(classes))
                turn_by = rng.normal(0, 0.4) + (math.pi if name == "barrier" and rng.random() < 0.5 else 0.0)
                out.append({"sample_token": token, "translation": t,
                            "size": [s * rng.uniform(0.7, 1.3) for s in b["size"]],
                            "rotation": turn(b["rotation"], turn_by),
                            "velocity": [v0[0] + rng.normal(0, 0.4), v0[1] + rng.normal(0, 0.4)],
                            "detection_name": name, "detection_score": float(rng.uniform(0.05, 1.0)),
                            "attribute_name": ""})
        sub["results"][token] = out
    return sub


class NuScenesNdsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="parallax_nds_")
        cls.root = os.path.join(cls.tmp, "nusc")
        rc, _, err = run("datagen", "--scenes", "4", "--val-scenes", "3", *SMALL, "--out", cls.root, "--layout",
                         "nuscenes", "--image-codec", "jpeg", "--quality", "90", "--samples-per-scene", "3")
        assert rc == 0, err
        cls.splits = os.path.join(cls.root, "parallax_splits.json")
        cls.data = os.path.join(cls.tmp, "conv")
        rc, _, err = run("convert", "nuscenes", "--dataroot", cls.root, "--out", cls.data, "--splits", cls.splits,
                         "--workers", "2", "--bev-range", "25", "--ego-x-offset", "0.7")
        assert rc == 0, err
        env = dict(os.environ, OMP_NUM_THREADS="1")
        common = ["--config", os.path.join(SRC, "configs", "bev_tiny.yaml"), f"data.path={cls.data}",
                  "data.batch_size=2", "train.device=cpu"]
        rc, _, err = run("train", *common, f"experiment.output_dir={cls.tmp}", "experiment.name=nds",
                         "train.steps=1", "train.eval_every=0", env=env)
        assert rc == 0, err[-3000:]
        cls.preds = os.path.join(cls.tmp, "dump.json")
        rc, _, err = run("eval", *common, "--checkpoint", os.path.join(cls.tmp, "nds"), "--dump-predictions",
                         cls.preds, env=env)
        assert rc == 0, err[-3000:]
        cls.gt_dump = os.path.join(cls.tmp, "dump_gt.json")
        with open(cls.preds[:-5] + "_metrics.json") as f:
            cls.eval_metrics = json.load(f)["metrics"]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def devkit(self, root, submission):
        with open(self.splits) as f:
            val_scenes = json.load(f)["val"]
        rows = os.path.join(self.tmp, "rows.txt")
        p = subprocess.run([DEVKIT_PY, "-c", DEVKIT_SCRIPT, root, submission, json.dumps(val_scenes),
                            os.path.join(self.tmp, "devkit_eval"), rows, VELOCITY_OF],
                           capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        return json.loads(p.stdout.strip().splitlines()[-1]), rows

    def assert_same(self, ours, theirs, what):
        self.compared += 1
        if theirs is None or (isinstance(theirs, float) and math.isnan(theirs)):
            self.assertIsNone(ours, f"{what}: the devkit has NaN, Parallax {ours}")
        else:
            self.assertIsNotNone(ours, f"{what}: Parallax has NaN, the devkit {theirs}")
            self.assertLessEqual(abs(ours - theirs), TOL, f"{what}: Parallax {ours}, devkit {theirs}")
            self.worst = max(self.worst, abs(ours - theirs))

    def compare(self, root, rename, probe):
        """The submission with known errors (classes renamed by `rename`) scored by the devkit
        against `root`'s ground truth, and by nds_tool on the devkit's boxes: every number equal
        within TOL. `probe`: a class that must have 0.05 < AP, AVE < 0.99. Returns (the
        ground-truth dump, the devkit's output, its metrics)."""
        with open(self.gt_dump) as f:
            gt_doc = json.load(f)
        submission = os.path.join(self.tmp, "submission.json")
        with open(submission, "w") as f:
            json.dump(submission_with_known_errors(gt_doc, 3, rename), f)
        r, rows = self.devkit(root, submission)
        m = r["metrics"]
        p = subprocess.run([NDS_TOOL, rows], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        ours = json.loads(p.stdout)
        print(f"\n  devkit: {r['gt']} ground-truth boxes ({r['injected']} given a velocity), {r['pred']} "
              f"predictions: mAP {m['mean_ap']:.4f}, NDS {m['nd_score']:.4f}, mAVE {m['tp_errors']['vel_err']:.4f}; "
              f"Parallax: mAP {ours['map']:.4f}, NDS {ours['nds']:.4f}, mAVE {ours['ave']:.4f}", file=sys.stderr)
        # Not trivial: AP strictly between 0 and 1 for the classes present, real (not 1) AVE with
        # unknown velocities mixed in, AAE 1 (no attributes predicted or annotated).
        self.assertGreater(r["injected"], 0)
        self.assertLess(r["injected"], r["gt"])
        self.assertTrue(0.05 < m["mean_dist_aps"][probe] < 0.99, m["mean_dist_aps"])
        self.assertTrue(0.05 < m["label_tp_errors"][probe]["vel_err"] < 0.99, m["label_tp_errors"][probe])
        self.assertEqual(m["tp_errors"]["attr_err"], 1.0)

        self.compared, self.worst = 0, 0.0
        self.assert_same(ours["map"], m["mean_ap"], "mAP")
        for c, ap in m["mean_dist_aps"].items():
            self.assert_same(ours[f"ap_{c}"], ap, f"AP {c}")
        for c, errs in m["label_tp_errors"].items():
            for name, key in TP.items():
                if key != "aae":  # per-class AAE is not a Parallax key (1 or NaN: detection_score.h)
                    self.assert_same(ours[f"{key}_{c}"], errs[name], f"{name} {c}")
        for name, key in TP.items():
            self.assert_same(ours[key], m["tp_errors"][name], f"mean {name}")
        self.assert_same(ours["nds"], m["nd_score"], "NDS")
        # nds_no_aae from the devkit's own scores.
        s = m["tp_scores"]
        want = (5 * m["mean_ap"] + sum(s[n] for n in TP if n != "attr_err")) / 9
        self.assert_same(ours["nds_no_aae"], want, "NDS without AAE")
        print(f"  {self.compared} numbers compared, the largest difference {self.worst:.3g}", file=sys.stderr)
        return gt_doc, r, m

    def test_parallax_metrics_equal_the_devkits_on_a_submission_with_known_errors(self):
        if not os.path.exists(DEVKIT_PY):
            self.skipTest(f"nuscenes-devkit not installed ({DEVKIT_PY}; scripts/setup.sh installs it)")
        # eval's own keys (train/evaluate.h), whatever the 1-step model scores.
        for k in ("ave", "aae", "nds", "nds_no_aae", "ave_car"):
            self.assertIn(k, self.eval_metrics)
        self.assertIsNone(self.eval_metrics["ave_barrier"])  # the devkit's exception, by name
        self.assertIsNone(self.eval_metrics["aoe_traffic_cone"])
        gt_doc, r, m = self.compare(self.root, {}, "car")

        # The dumps: predictions' velocities (0, 0) (no velocity head), every finite ground-truth
        # velocity the devkit's (float32 in the ego frame, rotated back: 1e-5 relative), the
        # others NaN.
        with open(self.preds) as f:
            pred_doc = json.load(f)
        self.assertTrue(all(b["velocity"] == [0.0, 0.0] for v in pred_doc["results"].values() for b in v))
        finite = 0
        for token, boxes in gt_doc["results"].items():
            folder = r["folder_velocity"].get(token, [])
            for b in boxes:
                v = b["velocity"]
                if not all(math.isfinite(x) for x in v):
                    self.assertTrue(all(math.isnan(x) for x in v), v)
                    continue
                t, want = min(folder, key=lambda tv: math.dist(tv[0][:2], b["translation"][:2]))
                self.assertLessEqual(math.dist(v, want), 1e-5 * (1 + math.hypot(*want)), (token, v, want))
                finite += 1
        print(f"  the ground-truth dump: {finite} finite velocities", file=sys.stderr)

    def test_barrier_and_traffic_cone_exceptions_equal_the_devkits(self):
        """The folder's pedestrians and bicycles renamed barrier and traffic cone (its category
        table edited in a copy; the submission renamed alike, half the barriers turned by pi): the
        devkit's exceptions (no AOE, AVE, AAE for cones; no AVE, AAE and period pi for barriers)
        against Parallax's, by class name, on true positives."""
        if not os.path.exists(DEVKIT_PY):
            self.skipTest(f"nuscenes-devkit not installed ({DEVKIT_PY}; scripts/setup.sh installs it)")
        root = os.path.join(self.tmp, "nusc_renamed")
        shutil.copytree(self.root, root)
        table = os.path.join(root, "v1.0-mini", "category.json")
        with open(table) as f:
            cats = json.load(f)
        names = {"human.pedestrian.adult": "movable_object.barrier", "vehicle.bicycle": "movable_object.trafficcone"}
        for cat in cats:
            cat["name"] = names.get(cat["name"], cat["name"])
        with open(table, "w") as f:
            json.dump(cats, f)
        _, _, m = self.compare(root, {"pedestrian": "barrier", "bicycle": "traffic_cone"}, "car")
        tp = m["label_tp_errors"]
        # Not vacuous: both classes have ground truth and true positives (AP > 0; ATE, in metres,
        # is not the no-true-positive 1), the
        # barriers' orientation is scored (period pi: the flipped half does not count as pi off).
        for c in ("barrier", "traffic_cone"):
            self.assertGreater(m["mean_dist_aps"][c], 0.05, c)
            self.assertNotEqual(tp[c]["trans_err"], 1.0, c)
        self.assertLess(tp["barrier"]["orient_err"], 0.5)
        self.assertTrue(math.isnan(tp["traffic_cone"]["orient_err"]))
        self.assertTrue(math.isnan(tp["barrier"]["vel_err"]) and math.isnan(tp["traffic_cone"]["vel_err"]))


if __name__ == "__main__":
    PARALLAX, NDS_TOOL = sys.argv[1], sys.argv[2]
    unittest.main(argv=sys.argv[:1], verbosity=2)
