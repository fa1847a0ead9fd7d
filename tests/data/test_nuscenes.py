#!/usr/bin/env python3
"""`parallax datagen --layout nuscenes` and `parallax convert nuscenes` (issue 38), end to end:

- sequences (`datagen --layout nuscenes --sequence-length`): one nuScenes scene per sequence with
  frame timestamps and instances linked prev/next; converted, its velocities are datagen's within
  the bound of float32 centres, as are nuscenes-devkit's box_velocity speeds, and each scene keeps
  its sequence, frame and previous keyframe (prev_index);
- the round trip: datagen's synthetic scenes written in the nuScenes layout (random global ego
  poses, boxes in the global frame, JPEG files) and converted back give datagen's own dataset of
  the same seed: box centres within 1e-4 m, yaws within 1e-5 rad, sizes, classes (vehicle -> car,
  pedestrian -> pedestrian, cyclist -> bicycle), visibility > 0, calibrations to float32 rounding,
  and images within JPEG error (PSNR >= 35 dB at quality 95); a conversion to half the size has
  exactly halved intrinsics and the box-averaged images within 30 dB;
- a model (bev_tiny) trains on a converted dataset, and `eval --dump-predictions` keys its
  results by the nuScenes sample tokens;
- nuscenes-devkit reads the layout: `NuScenes(...)` opens it and `get_sample_data()` gives, for
  every camera, the ground truth's boxes in that camera's frame (skipped only where the devkit
  is not installed: scripts/setup.sh installs it into its own venv, PARALLAX_NUSCENES_PYTHON);
- resume: a conversion whose shard and dataset.json were lost (and a killed run's .tmp left)
  keeps the complete shards and rewrites the missing one bitwise; other options are refused;
- the map expansion layers (drivable area, walkways, dividers) rasterised into the BEV labels
  match the generator's road cells; without the maps folder the labels are the boxes' footprints;
- bad input, each one `parallax: error:` line naming the file, table or token, with no shard or
  dataset.json committed: a missing table, a missing map file, a missing JPEG, a truncated JPEG, a wrong version
  folder, a full disk (a file size limit); an unmapped category is ignored and counted;
- hostile tables (issue: a review by a hostile user): a sample_data filename with a '..'
  component or an absolute one, and a log location with '..', are refused (nothing outside the
  dataroot is read), while a symlinked samples folder converts; numbers beyond float32 (1e39,
  1e300) are refused naming the table and the token; a 50 MB location is echoed clipped; a kept
  shard with flipped bytes is verified on resume, converted again and then inspects; an
  out-of-range --image-size names the limit; a --splits scene that does not exist is refused;
  the tables' reading prints progress lines with an ETA.

Usage: test_nuscenes.py <parallax>
"""
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_data_cli  # noqa: E402  (assert_one_error_line)

PARALLAX = None
SMALL = ["--height", "128", "--width", "224", "--threads", "2", "--seed", "5"]
DEVKIT_PY = os.environ.get("PARALLAX_NUSCENES_PYTHON", os.path.join(
    os.environ.get("PARALLAX_NUSCENES_VENV", os.path.expanduser("~/.cache/parallax/nuscenes-venv")), "bin", "python3"))
# Native class -> converted class (data/nuscenes.cpp writes the synthetic classes as these
# nuScenes categories, which the default mapping turns into detection classes).
CLASS_MAP = {0: 0, 1: 5, 2: 7}  # vehicle -> car, pedestrian -> pedestrian, cyclist -> bicycle


def run(*args, env=None):
    p = subprocess.run([PARALLAX, *args], capture_output=True, text=True, timeout=600, env=env)
    return p.returncode, p.stdout, p.stderr


def scenes(ds, split):
    """{index: {name: array, 'token': str, 'images': uint8 [N, H, W, 3]}} of a dataset's split."""
    from PIL import Image
    with open(os.path.join(ds, "dataset.json")) as f:
        info = json.load(f)
    out = {}
    for shard in info["splits"][split]["shards"]:
        with h5py.File(os.path.join(ds, shard), "r") as f:
            for name, g in f["scenes"].items():
                s = {k: g[k][()] for k in g if k not in ("images_jpeg", "images_jpeg_offsets")}
                if "images_jpeg" in g:
                    b, o = g["images_jpeg"][()], g["images_jpeg_offsets"][()]
                    s["images"] = np.stack([np.asarray(Image.open(io.BytesIO(b[o[c]:o[c + 1]].tobytes())).convert("RGB"))
                                            for c in range(len(o) - 1)])
                s["token"] = g.attrs.get("sample_token", b"")
                if isinstance(s["token"], bytes):
                    s["token"] = s["token"].decode()
                out[int(name)] = s
    return out


def psnr(a, b):
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255.0 ** 2 / mse)


class NuScenesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="parallax_nuscenes_")
        cls.native = os.path.join(cls.tmp, "native")
        cls.root = os.path.join(cls.tmp, "nusc")
        for args in (["--out", cls.native], ["--out", cls.root, "--layout", "nuscenes", "--image-codec", "jpeg",
                                             "--quality", "95", "--samples-per-scene", "3"]):
            rc, _, err = run("datagen", "--scenes", "5", "--val-scenes", "3", *SMALL, *args)
            assert rc == 0, err
        cls.splits = os.path.join(cls.root, "parallax_splits.json")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def convert(self, out, *extra, root=None):
        return run("convert", "nuscenes", "--dataroot", root or self.root, "--out", out, "--splits", self.splits,
                   "--workers", "2", "--bev-range", "25", *extra)

    def assert_one_error_line(self, rc, err, *needles):
        return test_data_cli.assert_one_error_line(self, rc, err, *needles)

    def copy_root(self, name):
        d = os.path.join(self.tmp, name)
        shutil.copytree(self.root, d)
        return d

    def test_round_trip_gives_datagens_scenes(self):
        out = os.path.join(self.tmp, "conv")
        rc, _, err = self.convert(out)
        self.assertEqual(rc, 0, err)
        with open(os.path.join(out, "dataset.json")) as f:
            info = json.load(f)
        self.assertEqual(info["image_codec"], "jpeg")
        self.assertEqual(info["bev_source"], "map expansion layers and box footprints")
        self.assertEqual(info["bev_classes"][:6], ["background", "drivable_area", "ped_crossing", "walkway",
                                                   "divider", "car"])
        self.assertEqual(info["box_classes"][0], "car")
        self.assertEqual({k: v["scenes"] for k, v in info["splits"].items()}, {"train": 5, "val": 3})
        rc, _, err = run("inspect", out)  # every scene read, decoded and checked
        self.assertEqual(rc, 0, err)
        worst = {"centre": 0.0, "yaw": 0.0, "calib": 0.0, "psnr": 1e9, "road_iou": 1.0}
        sq, count = 0.0, 0
        for split in ("train", "val"):
            nat, conv = scenes(self.native, split), scenes(out, split)
            self.assertEqual(sorted(nat), sorted(conv))
            for i in nat:
                a, b = nat[i], conv[i]
                self.assertEqual(len(b["token"]), 32, b["token"])
                self.assertEqual(a["boxes"].shape, b["boxes"].shape)
                self.assertEqual(b["velocities"].shape, (len(b["boxes"]), 2))
                self.assertTrue(np.all(np.isnan(b["velocities"])))  # one annotation per instance
                na, nb = a["boxes"].astype(np.float64), b["boxes"].astype(np.float64)
                worst["centre"] = max(worst["centre"], np.abs(na[:, :3] - nb[:, :3]).max(initial=0))
                dyaw = np.abs((na[:, 6] - nb[:, 6] + np.pi) % (2 * np.pi) - np.pi)
                worst["yaw"] = max(worst["yaw"], dyaw.max(initial=0))
                np.testing.assert_allclose(nb[:, 3:6], na[:, 3:6], rtol=0, atol=1e-6)
                self.assertEqual([CLASS_MAP[int(c)] for c in na[:, 7]], [int(c) for c in nb[:, 7]])
                self.assertEqual(list(na[:, 8] > 0), list(nb[:, 8] > 0))
                for k in ("intrinsics", "cam_to_ego"):
                    worst["calib"] = max(worst["calib"], np.abs(a[k].astype(np.float64) - b[k]).max())
                worst["psnr"] = min(worst["psnr"], min(psnr(a["images"][c], b["images"][c]) for c in range(6)))
                # BEV from the map layers: the drivable area (with the crossings and dividers on
                # it) against the generator's road and marking cells, objects set aside.
                na, nb = a["bev_semantics"], b["bev_semantics"]
                objects = (na >= 3) | (nb >= 5)
                road_a = np.isin(na, [1, 2]) & ~objects
                road_b = np.isin(nb, [1, 2, 4]) & ~objects
                worst["road_iou"] = min(worst["road_iou"], (road_a & road_b).sum() / (road_a | road_b).sum())
                self.assertGreater(int(np.sum(nb == 3)), 0)  # walkways
                sq += float(np.sum((a["images"].astype(np.float64) - b["images"]) ** 2))
                count += a["images"].size
        pooled = 10 * np.log10(255.0 ** 2 / (sq / count))
        print(f"\n  round trip: centres {worst['centre']:.3g} m, yaws {worst['yaw']:.3g} rad, calibrations "
              f"{worst['calib']:.3g}, PSNR {pooled:.1f} dB (worst camera {worst['psnr']:.1f} dB), "
              f"road IoU >= {worst['road_iou']:.4f}", file=sys.stderr)
        # The bounds. The arithmetic: float32 centres of up to 25 m (ulp 2e-6) moved by a
        # double-precision pose of up to 1500 m and back; yaws through a quaternion in double.
        self.assertLessEqual(worst["centre"], 1e-4)
        self.assertLessEqual(worst["yaw"], 1e-5)
        # Calibrations: the float32 values through double and back: at most one float32 rounding
        # of values below 300 px (ulp 3e-5) and of rotations and translations below 2 (ulp 2.4e-7).
        self.assertLessEqual(worst["calib"], 3.1e-5)
        # JPEG at quality 95 of these renderings (measured on this dataset: 38.2 dB pooled, the
        # worst camera 34.1 dB; libjpeg-turbo's accurate DCT is exact integer arithmetic, so the
        # same on any x86-64 CPU): the 35 dB over the images, 30 dB for any one camera.
        self.assertGreaterEqual(pooled, 35.0)
        # The same road rectangles on both sides; only cells whose centre lies within rounding of
        # a road edge (the map went through global coordinates and back) may differ: measured
        # 0-5 cells a scene (5 differing cells at IoU 0.9978: about 2,300 road cells).
        self.assertGreaterEqual(worst["road_iou"], 0.99)
        self.assertGreaterEqual(worst["psnr"], 30.0)

    def test_a_model_trains_on_the_converted_dataset_and_eval_writes_its_sample_tokens(self):
        out = os.path.join(self.tmp, "conv_train")
        rc, _, err = self.convert(out, "--image-size", "64", "112")  # resized: re-encoded at q 95
        self.assertEqual(rc, 0, err)
        with open(os.path.join(out, "dataset.json")) as f:
            self.assertEqual(json.load(f)["jpeg_quality"], 95)
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # The model sees 3 of the 6 cameras at half the stored size: decoded at 1/2 in the DCT
        # domain, the others never decoded (data.cameras, data.image_size).
        common = ["--config", os.path.join(src, "configs", "bev_tiny.yaml"), f"data.path={out}",
                  "data.batch_size=2", "train.device=cpu", "data.image_size=[32,56]", "data.cameras=[0,1,3]"]
        rc, _, err = run("train", *common, f"experiment.output_dir={self.tmp}", "experiment.name=nusc",
                         "train.steps=2", "train.eval_every=0", "schedule.warmup_steps=1", "train.log_every=1",
                         env=env)
        self.assertEqual(rc, 0, err[-3000:])
        with open(os.path.join(self.tmp, "nusc", "metrics.jsonl")) as f:
            rows = [json.loads(l) for l in f if l.strip()]
        losses = [r["loss"] for r in rows if r["kind"] == "train"]
        self.assertEqual(len(losses), 2)
        self.assertTrue(all(np.isfinite(losses)))
        preds = os.path.join(self.tmp, "preds.json")
        rc, _, err = run("eval", *common, "--checkpoint", os.path.join(self.tmp, "nusc"), "--dump-predictions",
                         preds, env=env)
        self.assertEqual(rc, 0, err[-3000:])
        tokens = [s["token"] for _, s in sorted(scenes(out, "val").items())]
        for f in (preds, os.path.join(self.tmp, "preds_gt.json")):
            with open(f) as fh:
                sub = json.load(fh)
            self.assertEqual(list(sub["results"]), tokens)
            for t, boxes in sub["results"].items():
                self.assertTrue(all(b["sample_token"] == t for b in boxes))
        with open(os.path.join(self.tmp, "preds_gt.json")) as fh:
            gt = json.load(fh)
        self.assertEqual(sum(len(b) for b in gt["results"].values()),
                         sum(int(np.sum(s["boxes"][:, 8] > 0)) for s in scenes(out, "val").values()))

    def test_without_map_expansion_the_bev_is_the_box_footprints(self):
        root = self.copy_root("nomaps")
        shutil.rmtree(os.path.join(root, "maps"))
        out, with_maps = os.path.join(self.tmp, "nomaps_out"), os.path.join(self.tmp, "maps_out")
        for r, o in ((root, out), (self.root, with_maps)):
            rc, _, err = self.convert(o, root=r)
            self.assertEqual(rc, 0, err)
        with open(os.path.join(out, "dataset.json")) as f:
            info = json.load(f)
        self.assertEqual(info["bev_source"], "box footprints")
        self.assertEqual(info["bev_classes"], ["background"] + info["box_classes"])
        a, b = scenes(out, "val"), scenes(with_maps, "val")
        for i in a:
            # The same object cells and classes, painted over the map layers in the other.
            na, nb = a[i]["bev_semantics"].astype(int), b[i]["bev_semantics"].astype(int)
            self.assertTrue(np.array_equal(na >= 1, nb >= 5))
            self.assertTrue(np.array_equal(na[na >= 1], nb[nb >= 5] - 4))

    def test_conversion_to_half_size_scales_the_intrinsics_exactly(self):
        out = os.path.join(self.tmp, "half")
        rc, _, err = self.convert(out, "--image-size", "64", "112", "--image-codec", "raw")
        self.assertEqual(rc, 0, err)
        nat, conv = scenes(self.native, "val"), scenes(out, "val")
        for i in nat:
            want = nat[i]["intrinsics"].astype(np.float64)
            want[:, :2, :] *= 0.5
            np.testing.assert_allclose(conv[i]["intrinsics"], want, rtol=0, atol=3.1e-5)
            self.assertEqual(conv[i]["images"].shape, (6, 64, 112, 3))
            # Against the native image's 2 x 2 box average (what a 1/2 DCT-domain decode
            # approximates; the JPEG in between): 30 dB.
            box = nat[i]["images"].astype(np.float64).reshape(6, 64, 2, 112, 2, 3).mean(axis=(2, 4))
            self.assertGreaterEqual(psnr(np.round(box), conv[i]["images"]), 30.0)

    def test_nuscenes_devkit_reads_the_layout(self):
        if not os.path.exists(DEVKIT_PY):
            self.skipTest(f"nuscenes-devkit not installed ({DEVKIT_PY}; scripts/setup.sh installs it)")
        script = r"""
import json, sys
from nuscenes.nuscenes import NuScenes
from nuscenes.utils.geometry_utils import BoxVisibility
from nuscenes.map_expansion.map_api import NuScenesMap
nusc = NuScenes(version="v1.0-mini", dataroot=sys.argv[1], verbose=False)
m = NuScenesMap(dataroot=sys.argv[1], map_name=nusc.log[0]["location"])
out = {"map": [len(m.drivable_area), len(m.walkway), len(m.lane_divider) + len(m.road_divider)]}
for s in nusc.sample:
    for ch, sd in s["data"].items():
        if not ch.startswith("CAM"):
            continue
        path, boxes, K = nusc.get_sample_data(sd, box_vis_level=BoxVisibility.NONE)
        out[s["token"] + "/" + ch] = {"K": K.tolist(), "boxes": [
            {"c": b.center.tolist(), "wlh": b.wlh.tolist(), "R": b.rotation_matrix.tolist(), "name": b.name}
            for b in boxes]}
json.dump(out, sys.stdout)
"""
        p = subprocess.run([DEVKIT_PY, "-c", script, self.root], capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        got = json.loads(p.stdout)
        self.assertTrue(all(n > 0 for n in got["map"]), got["map"])  # the devkit's map API reads the map
        out = os.path.join(self.tmp, "conv_devkit")
        rc, _, err = self.convert(out)
        self.assertEqual(rc, 0, err)
        cams = ["CAM_FRONT", "CAM_FRONT_LEFT", "CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT", "CAM_FRONT_RIGHT"]
        names = {0: "vehicle.car", 1: "human.pedestrian.adult", 2: "vehicle.bicycle"}
        worst_c, worst_r, n = 0.0, 0.0, 0
        for split in ("train", "val"):
            nat, conv = scenes(self.native, split), scenes(out, split)
            for i in nat:
                for c, ch in enumerate(cams):
                    g = got[conv[i]["token"] + "/" + ch]
                    np.testing.assert_allclose(np.array(g["K"]), nat[i]["intrinsics"][c], rtol=0, atol=3.1e-5)
                    T = nat[i]["cam_to_ego"][c].astype(np.float64)
                    R, t = T[:3, :3], T[:3, 3]
                    boxes = nat[i]["boxes"].astype(np.float64)
                    self.assertEqual(len(g["boxes"]), len(boxes))
                    for b, want in zip(g["boxes"], boxes):
                        centre = R.T @ (want[:3] - t)
                        yaw = want[6]
                        rz = np.array([[np.cos(yaw), -np.sin(yaw), 0], [np.sin(yaw), np.cos(yaw), 0], [0, 0, 1]])
                        worst_c = max(worst_c, np.abs(np.array(b["c"]) - centre).max())
                        worst_r = max(worst_r, np.abs(np.array(b["R"]) - R.T @ rz).max())
                        np.testing.assert_allclose(b["wlh"], want[[4, 3, 5]], rtol=0, atol=1e-6)
                        self.assertEqual(b["name"], names[int(want[7])])
                        n += 1
        print(f"\n  nuscenes-devkit: {n} camera-frame boxes, centres within {worst_c:.3g} m, rotations "
              f"{worst_r:.3g}", file=sys.stderr)
        self.assertGreater(n, 0)
        # tools/nuscenes_splits.py: the official splits from the devkit, as --splits takes them.
        tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools", "nuscenes_splits.py")
        p = subprocess.run([DEVKIT_PY, tool, "--version", "v1.0-trainval"], capture_output=True, text=True,
                           timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual({k: len(v) for k, v in json.loads(p.stdout).items()}, {"train": 700, "val": 150})
        # The same bounds as the round trip (the camera frame: one more rigid move in double).
        self.assertLessEqual(worst_c, 1e-4)
        self.assertLessEqual(worst_r, 1e-5)

    def test_the_devkit_scores_an_eval_dump_against_its_own_ground_truth(self):
        """`eval --dump-predictions` on a converted dataset writes nuScenes sample tokens and boxes in
        the global frame: the devkit's DetectionEval, reading the ground truth from the nuScenes
        folder itself, scores our ground-truth dump (as a submission) at AP 1 with zero errors."""
        if not os.path.exists(DEVKIT_PY):
            self.skipTest(f"nuscenes-devkit not installed ({DEVKIT_PY}; scripts/setup.sh installs it)")
        out = os.path.join(self.tmp, "conv_score")
        rc, _, err = self.convert(out, "--ego-x-offset", "1.3")  # any origin: the pose undoes it
        self.assertEqual(rc, 0, err)
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        common = ["--config", os.path.join(src, "configs", "bev_tiny.yaml"), f"data.path={out}",
                  "data.batch_size=2", "train.device=cpu"]
        rc, _, err = run("train", *common, f"experiment.output_dir={self.tmp}", "experiment.name=score",
                         "train.steps=1", "train.eval_every=0", env=env)
        self.assertEqual(rc, 0, err[-3000:])
        preds = os.path.join(self.tmp, "score.json")
        rc, _, err = run("eval", *common, "--checkpoint", os.path.join(self.tmp, "score"), "--dump-predictions",
                         preds, env=env)
        self.assertEqual(rc, 0, err[-3000:])
        with open(os.path.join(self.tmp, "score_gt.json")) as f:
            sub = json.load(f)
        for boxes in sub["results"].values():
            for b in boxes:
                b["detection_score"] = 1.0
        submission = os.path.join(self.tmp, "submission.json")
        with open(submission, "w") as f:
            json.dump(sub, f)
        with open(self.splits) as f:
            val_scenes = json.load(f)["val"]
        script = r"""
import json, sys
import nuscenes.eval.common.loaders as loaders
from nuscenes.nuscenes import NuScenes
from nuscenes.eval.common.config import config_factory
from nuscenes.eval.detection.evaluate import DetectionEval
val = json.loads(sys.argv[3])
loaders.create_splits_scenes = lambda verbose=False: {"mini_val": val, "mini_train": []}
nusc = NuScenes(version="v1.0-mini", dataroot=sys.argv[1], verbose=False)
ev = DetectionEval(nusc, config_factory("detection_cvpr_2019"), sys.argv[2], "mini_val", sys.argv[4], verbose=False)
metrics, _ = ev.evaluate()
m = metrics.serialize()
json.dump({"ap": m["mean_dist_aps"], "tp": m["label_tp_errors"], "gt": len(ev.gt_boxes.all)}, sys.stdout)
"""
        p = subprocess.run([DEVKIT_PY, "-c", script, self.root, submission, json.dumps(val_scenes),
                            os.path.join(self.tmp, "devkit_eval")], capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        r = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"\n  devkit on our ground-truth dump: AP {r['ap']}, {r['gt']} ground-truth boxes", file=sys.stderr)
        self.assertGreater(r["gt"], 0)
        for cls in ("car", "pedestrian", "bicycle"):
            self.assertAlmostEqual(r["ap"][cls], 1.0, places=6, msg=cls)
            # Translation, scale and orientation errors: the same boxes, moved there and back.
            for err_name in ("trans_err", "scale_err", "orient_err"):
                self.assertLess(r["tp"][cls][err_name], 1e-4, f"{cls} {err_name}")

    def test_resume_keeps_complete_shards_and_refuses_other_options(self):
        out = os.path.join(self.tmp, "resume")
        rc, _, err = self.convert(out, "--shard-scenes", "2")
        self.assertEqual(rc, 0, err)
        shards = sorted(glob.glob(os.path.join(out, "*.h5")))
        self.assertEqual(len(shards), 5)  # train 3 + val 2
        with open(shards[1], "rb") as f:
            before = f.read()
        # A run killed while writing shard 1: that shard is not there, a .tmp is, no dataset.json.
        os.remove(shards[1])
        os.remove(os.path.join(out, "dataset.json"))
        with open(shards[1] + ".tmp", "wb") as f:
            f.write(b"partial")
        rc, _, err = self.convert(out, "--shard-scenes", "2")
        self.assertEqual(rc, 0, err)
        self.assertIn("resuming: 4 complete shard(s) kept, 2 of 8 samples to go", err)
        with open(shards[1], "rb") as f:
            self.assertEqual(f.read(), before)
        self.assertFalse(os.path.exists(shards[1] + ".tmp"))
        self.assertTrue(os.path.exists(os.path.join(out, "dataset.json")))
        rc, _, err = self.convert(out, "--shard-scenes", "3")
        self.assert_one_error_line(rc, err, out, "other options", "--overwrite")

    def assert_nothing_committed(self, out, complete=()):
        """No dataset.json, no temporary file, and no shard but the `complete` ones (those written
        whole before the bad sample's shard, which a rerun keeps)."""
        self.assertEqual(sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.h5"))),
                         sorted(complete))
        self.assertEqual(glob.glob(os.path.join(out, "*.tmp")), [])
        self.assertFalse(os.path.exists(os.path.join(out, "dataset.json")))

    def test_bad_input_is_one_line_naming_it_and_commits_nothing(self):
        # A missing table.
        root = self.copy_root("no_instance")
        os.remove(os.path.join(root, "v1.0-mini", "instance.json"))
        out = os.path.join(self.tmp, "bad1")
        rc, _, err = self.convert(out, root=root)
        self.assert_one_error_line(rc, err, "table 'instance' is missing", "instance.json")
        self.assert_nothing_committed(out)
        # A map expansion folder without the log location's map.
        root = self.copy_root("no_map_file")
        os.remove(os.path.join(root, "maps", "expansion", "boston-seaport.json"))
        rc, _, err = self.convert(out, root=root)
        self.assert_one_error_line(rc, err, "map expansion file", "boston-seaport.json", "is missing")
        self.assert_nothing_committed(out)
        # A wrong version folder.
        rc, _, err = self.convert(out, "--version", "v1.0-trainval")
        self.assert_one_error_line(rc, err, "no version folder 'v1.0-trainval'", "it holds v1.0-mini")
        # A missing JPEG, and a truncated one (in the last scene, so earlier scenes were converted).
        root = self.copy_root("bad_jpeg")
        with open(os.path.join(root, "v1.0-mini", "sample_data.json")) as f:
            sd = json.load(f)
        last = sd[-1]
        os.remove(os.path.join(root, last["filename"]))
        out = os.path.join(self.tmp, "bad2")
        rc, _, err = self.convert(out, root=root)
        self.assert_one_error_line(rc, err, last["sample_token"], last["token"], last["filename"], "is missing")
        self.assert_nothing_committed(out, ["train_00000.h5"])  # the bad sample is in val
        victim = os.path.join(root, sd[-2]["filename"])
        shutil.copy(os.path.join(self.root, last["filename"]), os.path.join(root, last["filename"]))
        with open(victim, "rb") as f:
            data = f.read()
        with open(victim, "wb") as f:
            f.write(data[: len(data) // 2])
        out = os.path.join(self.tmp, "bad3")
        rc, _, err = self.convert(out, root=root)
        self.assert_one_error_line(rc, err, sd[-2]["sample_token"], sd[-2]["filename"])
        self.assert_nothing_committed(out, ["train_00000.h5"])
        # An unmapped category: its boxes are ignored and counted.
        root = self.copy_root("animal")
        path = os.path.join(root, "v1.0-mini", "category.json")
        with open(path) as f:
            cats = json.load(f)
        for c in cats:
            if c["name"] == "vehicle.bicycle":
                c["name"] = "animal"
        with open(path, "w") as f:
            json.dump(cats, f)
        out = os.path.join(self.tmp, "animal_out")
        rc, _, err = self.convert(out, root=root)
        self.assertEqual(rc, 0, err)
        native_cyclists = sum(int(np.sum(s["boxes"][:, 7] == 2)) for split in ("train", "val")
                              for s in scenes(self.native, split).values())
        self.assertGreater(native_cyclists, 0)
        self.assertIn(f"{native_cyclists} boxes of unmapped categories ignored: animal {native_cyclists}", err)
        # A full disk: a file size limit (SIGXFSZ ignored, so a write fails with EFBIG as with
        # ENOSPC) under the shard being written.
        out = os.path.join(self.tmp, "full")
        p = subprocess.run(["bash", "-c", 'trap "" XFSZ; ulimit -f 64; exec "$@"', "_", PARALLAX, "convert",
                            "nuscenes", "--dataroot", self.root, "--out", out, "--splits", self.splits,
                            "--workers", "2", "--bev-range", "25", "--image-codec", "raw", "--compression", "0"],
                           capture_output=True, text=True, timeout=300)
        line = self.assert_one_error_line(p.returncode, p.stderr, "train_00000.h5")
        self.assertRegex(line, r"disk full|cannot|write", line)
        self.assert_nothing_committed(out)


class HostileTablesTest(unittest.TestCase):
    """What a hostile (or careless) nuScenes folder or command line must not get past the converter.
    One small fake dataroot (2 + 1 samples) serves every case; each case's dataroot copies its
    tables (and maps) and symlinks `samples/` to the original's, as users symlink it to another
    disk, so the symlinked folder is exercised by every conversion here."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="parallax_nuscenes_hostile_")
        cls.root = os.path.join(cls.tmp, "nusc")
        rc, _, err = run("datagen", "--scenes", "2", "--val-scenes", "1", "--height", "64", "--width", "112",
                         "--threads", "2", "--seed", "7", "--out", cls.root, "--layout", "nuscenes",
                         "--image-codec", "jpeg", "--samples-per-scene", "2")
        assert rc == 0, err
        cls.splits = os.path.join(cls.root, "parallax_splits.json")
        with open(os.path.join(cls.root, "v1.0-mini", "sample_data.json")) as f:
            # The first camera record is the first converted sample's CAM_FRONT.
            cls.first_cam = next(r for r in json.load(f) if r["fileformat"] == "jpg")
        # A JPEG and a map file outside every dataroot, which a table could point to.
        cls.outside = os.path.join(cls.tmp, "outside")
        os.makedirs(cls.outside)
        shutil.copy(os.path.join(cls.root, cls.first_cam["filename"]), os.path.join(cls.outside, "x.jpg"))
        shutil.copy(os.path.join(cls.root, "maps", "expansion", "boston-seaport.json"),
                    os.path.join(cls.outside, "boston-seaport.json"))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def assert_one_error_line(self, rc, err, *needles):
        return test_data_cli.assert_one_error_line(self, rc, err, *needles)

    def dataroot(self, name, edit=None):
        """A dataroot `<tmp>/<name>`: the tables and maps copied, `samples/` a symlink to the
        original's; `edit(tables)` changes {table name: rows} before they are written."""
        d = os.path.join(self.tmp, name)
        shutil.copytree(os.path.join(self.root, "v1.0-mini"), os.path.join(d, "v1.0-mini"))
        shutil.copytree(os.path.join(self.root, "maps"), os.path.join(d, "maps"))
        os.symlink(os.path.join(self.root, "samples"), os.path.join(d, "samples"))
        if edit:
            tables = {}
            for t in ("sample_data", "calibrated_sensor", "ego_pose", "sample_annotation", "log"):
                with open(os.path.join(d, "v1.0-mini", t + ".json")) as f:
                    tables[t] = json.load(f)
            edit(tables)
            for t, rows in tables.items():
                with open(os.path.join(d, "v1.0-mini", t + ".json"), "w") as f:
                    json.dump(rows, f)
        return d

    def convert(self, root, out=None, *extra):
        out = out or root + "_out"
        return run("convert", "nuscenes", "--dataroot", root, "--out", out, "--splits", self.splits,
                   "--workers", "2", "--bev-range", "10", *extra)

    def assert_refused(self, root, *needles):
        rc, _, err = self.convert(root)
        line = self.assert_one_error_line(rc, err, *needles)
        self.assertLess(len(line), 1000, line[:2000])
        out = root + "_out"
        self.assertEqual(glob.glob(os.path.join(out, "*.h5")), [])
        self.assertFalse(os.path.exists(os.path.join(out, "dataset.json")))
        return line

    def set_first_camera(self, key, value):
        def edit(t):
            next(r for r in t["sample_data"] if r["token"] == self.first_cam["token"])[key] = value
        return edit

    def test_a_symlinked_samples_folder_converts(self):
        # The path rule is lexical: samples/ linked to another disk (outside the dataroot) is read.
        root = self.dataroot("symlinked")
        self.assertTrue(os.path.islink(os.path.join(root, "samples")))
        rc, _, err = self.convert(root)
        self.assertEqual(rc, 0, err)
        rc, _, err = run("inspect", root + "_out")
        self.assertEqual(rc, 0, err)

    def test_reading_the_tables_prints_progress_lines_with_an_eta(self):
        # The tables' reading (minutes of JSON on v1.0-trainval, silent before) and the samples:
        # lines with an ETA, on stderr with the other log lines.
        rc, _, err = self.convert(self.root, os.path.join(self.tmp, "progress_out"))
        self.assertEqual(rc, 0, err)
        self.assertRegex(err, r"convert tables \(KiB\) 0/\d+ \(0%\) .*\| ETA \S+")
        self.assertRegex(err, r"convert tables \(KiB\) (\d+)/\1 \(100%\) \| [^|]+/s \| log\.json \| elapsed \S+ \| ETA 0s")
        self.assertRegex(err, r"convert maps \(KiB\) (\d+)/\1 \(100%\) .*\| ETA 0s")
        self.assertRegex(err, r"convert sample (\d+)/\1 \(100%\) .*\| ETA 0s")

    def test_a_filename_with_dotdot_is_refused(self):
        # '../outside/x.jpg' from <tmp>/dotdot is a real JPEG: the rule refuses it, not the file.
        path = "../outside/x.jpg"
        root = self.dataroot("dotdot", self.set_first_camera("filename", path))
        self.assertTrue(os.path.isfile(os.path.join(root, path)))
        self.assert_refused(root, "sample_data.json", self.first_cam["token"], path, "'..'", "filename")

    def test_an_absolute_filename_is_refused(self):
        path = os.path.join(self.outside, "x.jpg")
        root = self.dataroot("absolute", self.set_first_camera("filename", path))
        self.assert_refused(root, "sample_data.json", self.first_cam["token"], path, "absolute")

    def test_a_location_with_dotdot_is_refused(self):
        # maps/expansion/../../../outside/boston-seaport.json is the real map file outside.
        loc = "../../../outside/boston-seaport"

        def edit(t):
            t["log"][0]["location"] = loc
        root = self.dataroot("location", edit)
        self.assertTrue(os.path.isfile(os.path.join(root, "maps", "expansion", loc + ".json")))
        self.assert_refused(root, "log.json", "location", loc, "'..'")

    def test_a_50mb_location_is_echoed_clipped(self):
        def edit(t):
            t["log"][0]["location"] = "x" * 50_000_000
        root = self.dataroot("long_location", edit)
        line = self.assert_refused(root, "log.json", "location", "50000000 bytes")
        self.assertLess(len(line), 1000)

    def test_numbers_beyond_float32_are_refused_naming_the_table_and_token(self):
        cam = self.first_cam

        def cs(t):
            return next(r for r in t["calibrated_sensor"] if r["token"] == cam["calibrated_sensor_token"])

        def first_ann(t):
            return t["sample_annotation"][0]
        cases = [  # (name, edit, table file, token of the record)
            ("cs_translation", lambda t: cs(t)["translation"].__setitem__(0, 1e39), "calibrated_sensor.json",
             cam["calibrated_sensor_token"]),
            ("intrinsic", lambda t: cs(t)["camera_intrinsic"][0].__setitem__(0, 1e300), "calibrated_sensor.json",
             cam["calibrated_sensor_token"]),
            ("ego_pose", lambda t: next(r for r in t["ego_pose"] if r["token"] == cam["ego_pose_token"])[
                "translation"].__setitem__(1, -1e300), "ego_pose.json", cam["ego_pose_token"]),
            ("ann_size", lambda t: first_ann(t)["size"].__setitem__(2, 1e39), "sample_annotation.json", None),
        ]
        for name, edit, table, token in cases:
            with self.subTest(name):
                tokens = {}

                def edit_and_note(t, edit=edit):
                    edit(t)
                    tokens["ann"] = first_ann(t)["token"]
                root = self.dataroot("f32_" + name, edit_and_note)
                self.assert_refused(root, table, token or tokens["ann"], "float32")

    def test_resume_redoes_a_kept_shard_whose_checksums_fail(self):
        root = self.dataroot("resume")
        out = root + "_out"
        rc, _, err = self.convert(root, out, "--shard-scenes", "1")
        self.assertEqual(rc, 0, err)
        shard = os.path.join(out, "train_00000.h5")
        with open(shard, "rb") as f:
            good = f.read()
        # Flip bytes inside the first camera's JPEG (stored as the source file's bytes).
        with open(os.path.join(self.root, self.first_cam["filename"]), "rb") as f:
            jpeg = f.read()
        at = good.find(jpeg[:256])
        self.assertGreater(at, 0)
        bad = bytearray(good)
        for i in range(at + 600, at + 616):
            bad[i] ^= 0xFF
        with open(shard, "wb") as f:
            f.write(bad)
        rc, _, err = self.convert(root, out, "--shard-scenes", "1")
        self.assertEqual(rc, 0, err)
        warn = [l for l in err.splitlines() if "WARN" in l and "train_00000.h5" in l]
        self.assertEqual(len(warn), 1, err)
        self.assertIn("converting it again", warn[0])
        self.assertIn("resuming: 2 complete shard(s) kept, 1 of 3 samples to go", err)
        self.assertRegex(err, r"convert verify kept shard 3/3 \(100%\) .*\| ETA \S+")
        with open(shard, "rb") as f:
            self.assertEqual(f.read(), good)
        rc, _, err = run("inspect", out)
        self.assertEqual(rc, 0, err)

    def test_an_out_of_range_image_size_names_the_limit(self):
        rc, _, err = run("convert", "nuscenes", "--dataroot", self.root, "--out", os.path.join(self.tmp, "size"),
                         "--image-size", "100000", "100")
        self.assert_one_error_line(rc, err, "--image-size 100000 100", "out of range", "8..4096")

    def test_a_splits_scene_that_does_not_exist_is_refused(self):
        splits = os.path.join(self.tmp, "typo_splits.json")
        with open(splits, "w") as f:
            json.dump({"train": ["scene-0000"], "val": ["scene-0001", "scene-00002"]}, f)
        out = os.path.join(self.tmp, "typo_out")
        rc, _, err = run("convert", "nuscenes", "--dataroot", self.root, "--out", out, "--splits", splits)
        self.assert_one_error_line(rc, err, "scene-00002", splits, "scene.json")
        self.assertFalse(os.path.exists(os.path.join(out, "dataset.json")))


class NuScenesSequenceTest(unittest.TestCase):
    """`datagen --layout nuscenes --sequence-length L`: each sequence is one nuScenes scene (its frames the
    samples, the moving ego's poses, instances linked prev/next); converting it gives the devkit-style
    velocities of datagen's own sequences and keeps the previous-keyframe links."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="parallax_nuscenes_seq_")
        cls.native = os.path.join(cls.tmp, "native")
        cls.root = os.path.join(cls.tmp, "nusc")
        small = ["--height", "40", "--width", "64", "--samples-per-pixel", "1", "--threads", "2", "--seed", "9",
                 "--sequence-length", "4"]
        # 10 train scenes: sequences of 4, 4 and 2 frames; 4 val scenes: one sequence.
        for args in (["--out", cls.native], ["--out", cls.root, "--layout", "nuscenes", "--image-codec", "jpeg"]):
            rc, _, err = run("datagen", "--scenes", "10", "--val-scenes", "4", *small, *args)
            assert rc == 0, err

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_the_layout_has_one_scene_per_sequence_with_linked_instances(self):
        tables = os.path.join(self.root, "v1.0-mini")
        def load(name):
            with open(os.path.join(tables, name + ".json")) as f:
                return json.load(f)
        scene, sample, ann, inst = load("scene"), load("sample"), load("sample_annotation"), load("instance")
        self.assertEqual([s["nbr_samples"] for s in scene], [4, 4, 2, 4])
        by_token = {s["token"]: s for s in sample}
        for sc in scene:
            tok, ts = sc["first_sample_token"], []
            while tok:
                ts.append(by_token[tok]["timestamp"])
                tok = by_token[tok]["next"]
            self.assertEqual(np.diff(ts).tolist(), [500000] * (len(ts) - 1))
        anns = {a["token"]: a for a in ann}
        for i in inst:
            chain, tok = [], i["first_annotation_token"]
            while tok:
                chain.append(tok)
                nxt = anns[tok]["next"]
                if nxt:
                    self.assertEqual(anns[nxt]["prev"], tok)
                tok = nxt
            self.assertEqual(len(chain), i["nbr_annotations"])
            self.assertEqual(chain[-1], i["last_annotation_token"])
        self.assertLess(len(inst), len(ann))  # objects seen in several frames are one instance

    def test_conversion_gives_datagens_velocities_and_previous_keyframes(self):
        out = os.path.join(self.tmp, "conv")
        rc, _, err = run("convert", "nuscenes", "--dataroot", self.root, "--out", out, "--splits",
                         os.path.join(self.root, "parallax_splits.json"), "--workers", "2", "--bev-range", "25")
        self.assertEqual(rc, 0, err)
        compared, moving = 0, 0
        for split in ("train", "val"):
            nat, conv = scenes(self.native, split), scenes(out, split)
            self.assertEqual(sorted(nat), sorted(conv))
            for i in nat:
                a, b = nat[i], conv[i]
                with h5py.File(os.path.join(out, f"{split}_00000.h5"), "r") as f:
                    cb = dict(f[f"scenes/{i:06d}"].attrs)
                with h5py.File(os.path.join(self.native, f"{split}_00000.h5"), "r") as f:
                    ca = dict(f[f"scenes/{i:06d}"].attrs)
                for k in ("sequence", "frame", "prev_index"):
                    self.assertEqual(cb[k], ca[k], f"{split} scene {i}: {k}")
                va, vb = a["velocities"].astype(np.float64), b["velocities"].astype(np.float64)
                self.assertEqual(va.shape, vb.shape)
                known = ~np.isnan(vb[:, 0])  # NaN: an instance in this frame only
                # The converter's centre difference of global centres over sample times against the
                # generator's exact velocity. Each centre is the float32 ego-frame centre (|x| <=
                # 25.25 m < 64: half an ulp, 2^-24 * 64 = 3.8e-6 m) carried through float64 poses of
                # < 10 km (~1e-12 m); the difference of two such, a vector of norm <= sqrt(2) * 2 *
                # 3.8e-6 m, over at least one frame interval (0.5 s), rotated (norm kept); plus both
                # sides' float32 storage of |v| < 16 m/s (2^-24 * 16 each).
                tol = np.sqrt(2) * 2 * 2.0 ** -24 * 64 / 0.5 + 2 * 2.0 ** -24 * 16 + 1e-9
                np.testing.assert_allclose(vb[known], va[known], rtol=0, atol=tol)
                compared += int(known.sum())
                moving += int((np.abs(va[known]).max(axis=1, initial=0) > 0).sum())
        self.assertGreater(compared, 50)
        self.assertGreater(moving, 10)

    def test_nuscenes_devkit_velocities_are_datagens_speeds(self):
        if not os.path.exists(DEVKIT_PY):
            self.skipTest(f"nuscenes-devkit not installed ({DEVKIT_PY}; scripts/setup.sh installs it)")
        # Per scene (by name) and sample (in order): the devkit's box_velocity of each annotation.
        script = r"""
import json, sys
from nuscenes.nuscenes import NuScenes
nusc = NuScenes(version="v1.0-mini", dataroot=sys.argv[1], verbose=False)
out = []
for sc in sorted(nusc.scene, key=lambda s: s["name"]):
    tok = sc["first_sample_token"]
    while tok:
        s = nusc.get("sample", tok)
        out.append([[float(v) for v in nusc.box_velocity(a)[:2]] for a in s["anns"]])
        tok = s["next"]
json.dump(out, sys.stdout)
"""
        p = subprocess.run([DEVKIT_PY, "-c", script, self.root], capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        got = json.loads(p.stdout)
        nat = [scenes(self.native, "train")[i] for i in range(10)] + [scenes(self.native, "val")[i] for i in range(4)]
        self.assertEqual(len(got), len(nat))
        compared = 0
        for g, a in zip(got, nat):
            vg, va = np.array(g, dtype=np.float64).reshape(-1, 2), a["velocities"].astype(np.float64)
            self.assertEqual(vg.shape, va.shape)
            known = ~np.isnan(vg[:, 0])
            # Global velocities (the devkit) against ego-frame ones: compare speeds, which a
            # rotation keeps. |speed difference| <= the norm of the velocity error: the centre
            # difference's (sqrt(2) * 2 * 2^-24 * 64 m over >= 0.5 s, as in the conversion test)
            # plus the stored float32 velocity's (sqrt(2) * 2^-24 * 16 m/s); the devkit's float64
            # arithmetic adds ~1e-12.
            tol = np.sqrt(2) * (2 * 2.0 ** -24 * 64 / 0.5 + 2.0 ** -24 * 16) + 1e-9
            np.testing.assert_allclose(np.hypot(vg[known, 0], vg[known, 1]), np.hypot(va[known, 0], va[known, 1]),
                                       rtol=0, atol=tol)
            compared += int(known.sum())
        self.assertGreater(compared, 50)


if __name__ == "__main__":
    PARALLAX = sys.argv[1]
    sys.argv = sys.argv[:1] + sys.argv[2:]
    unittest.main(verbosity=2)
