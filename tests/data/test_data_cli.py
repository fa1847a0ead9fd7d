#!/usr/bin/env python3
"""End-to-end tests of `parallax datagen` and `parallax inspect`, and of the shard layout as another
HDF5 reader (h5py) sees it. Usage: test_data_cli.py <parallax>."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

PARALLAX = None
SRC = os.environ.get("PARALLAX_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
SMALL = ["--cameras", "3", "--height", "40", "--width", "64", "--samples-per-pixel", "1", "--threads", "2"]


def run(*args):
    p = subprocess.run([PARALLAX, *args], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def assert_one_error_line(test, rc, err, *needles):
    """A failed command printed exactly one `parallax: error:` line (besides log lines) holding every
    needle, and no HDF5 diagnostics; returns the line."""
    test.assertNotEqual(rc, 0)
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("[parallax")]
    test.assertEqual(len(lines), 1, f"expected one error line, got: {err!r}")
    test.assertTrue(lines[0].startswith("parallax: error: "), lines[0])
    for n in needles:
        test.assertIn(n, lines[0])
    test.assertNotIn("HDF5-DIAG", err)
    return lines[0]


class DataCliTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="parallax_data_cli_")
        cls.ds = os.path.join(cls.tmp, "synth")
        rc, out, err = run("datagen", "--out", cls.ds, "--scenes", "5", "--val-scenes", "2", "--shard-scenes", "3",
                           "--seed", "3", *SMALL)
        assert rc == 0, err
        cls.datagen_log = err

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def assert_one_error_line(self, rc, err, *needles):
        return assert_one_error_line(self, rc, err, *needles)

    def test_help_lists_the_verbs_and_their_options(self):
        rc, out, _ = run("--help")
        self.assertEqual(rc, 0)
        self.assertIn("datagen", out)
        self.assertIn("inspect", out)
        rc, out, _ = run("datagen", "--help")
        self.assertEqual(rc, 0)
        for s in ("--out DIR", "--scenes N", "--val-scenes M", "--cameras N", "--seed S", "--shard-scenes K",
                  "--threads T", "--sequence-length L", "--frame-interval S", "examples:"):
            self.assertIn(s, out)
        rc, out, _ = run("inspect", "--help")
        self.assertEqual(rc, 0)
        self.assertIn("--quick", out)

    def test_datagen_writes_the_documented_folder(self):
        with open(os.path.join(self.ds, "dataset.json")) as f:
            meta = json.load(f)
        self.assertEqual(meta["schema_version"], 1)
        self.assertEqual((meta["cameras"], meta["image_height"], meta["image_width"]), (3, 40, 64))
        self.assertEqual(meta["bev"], {"x_min": -25, "x_max": 25, "y_min": -25, "y_max": 25, "resolution": 0.5})
        self.assertEqual(meta["box_classes"], ["vehicle", "pedestrian", "cyclist"])
        self.assertEqual(meta["splits"]["train"], {"shards": ["train_00000.h5", "train_00001.h5"], "scenes": 5})
        self.assertEqual(meta["splits"]["val"], {"shards": ["val_00000.h5"], "scenes": 2})
        self.assertEqual(sorted(os.listdir(self.ds)),
                         ["dataset.json", "train_00000.h5", "train_00001.h5", "val_00000.h5"])
        self.assertIn("datagen scene", self.datagen_log)  # progress lines

    def test_h5py_reads_the_documented_datasets_and_shapes(self):
        import h5py
        with h5py.File(os.path.join(self.ds, "train_00001.h5"), "r") as f:
            self.assertEqual(int(f.attrs["schema_version"]), 1)
            self.assertEqual(sorted(f["scenes"].keys()), ["000003", "000004"])
            s = f["scenes/000004"]
            self.assertEqual(sorted(s.keys()), ["bev_semantics", "boxes", "cam_to_ego", "images", "intrinsics"])
            self.assertEqual((s["images"].dtype.str, s["images"].shape), ("|u1", (3, 40, 64, 3)))
            self.assertEqual((s["intrinsics"].dtype.str, s["intrinsics"].shape), ("<f4", (3, 3, 3)))
            self.assertEqual((s["cam_to_ego"].dtype.str, s["cam_to_ego"].shape), ("<f4", (3, 4, 4)))
            self.assertEqual((s["bev_semantics"].dtype.str, s["bev_semantics"].shape), ("|u1", (100, 100)))
            self.assertEqual(s["boxes"].dtype.str, "<f4")
            self.assertEqual(s["boxes"].shape[1], 9)
            boxes = s["boxes"][()]
            self.assertGreater(boxes.shape[0], 3)
            self.assertTrue(set(boxes[:, 7].tolist()) <= {0.0, 1.0, 2.0})
            images = s["images"][()]
            self.assertGreater(int(images.max()), int(images.min()))  # real pictures, not a constant
            self.assertLess(int(s["bev_semantics"][()].max()), 6)

    def test_inspect_dataset_reports_and_verifies(self):
        rc, out, err = run("inspect", self.ds)
        self.assertEqual(rc, 0, err)
        for s in ("schema version: 1", "cameras: 3, images 40 x 64", "bev grid: 100 x 100 cells",
                  "split train: 5 scenes in 2 shard(s)", "split val: 2 scenes in 1 shard(s)",
                  "train_00000.h5: 3 scenes (000000..000002)", "000000: images uint8 [3, 40, 64, 3]",
                  "boxes float32 [", "verified: all 5 scenes", "bev cells: background", "boxes: vehicle"):
            self.assertIn(s, out)

    def test_inspect_shard_reports_per_scene_shapes(self):
        rc, out, err = run("inspect", os.path.join(self.ds, "val_00000.h5"))
        self.assertEqual(rc, 0, err)
        self.assertIn("scenes: 2 (000000..000001)", out)
        self.assertIn("000001: images uint8 [3, 40, 64, 3]", out)
        self.assertIn("verified: all 2 scenes", out)

    def test_inspect_names_the_bad_file(self):
        bad = os.path.join(self.tmp, "bad")
        shutil.copytree(self.ds, bad)
        shard = os.path.join(bad, "train_00001.h5")
        os.truncate(shard, os.path.getsize(shard) // 2)
        rc, _, err = run("inspect", bad)
        self.assert_one_error_line(rc, err, shard, "truncated")
        os.remove(shard)
        rc, _, err = run("inspect", bad)
        self.assert_one_error_line(rc, err, shard, "not found")
        rc, _, err = run("inspect", os.path.join(self.tmp, "missing"))
        self.assert_one_error_line(rc, err, "does not exist")
        rc, _, err = run("inspect", self.tmp)
        self.assert_one_error_line(rc, err, "cannot tell what")

    def test_shard_entries_outside_the_dataset_folder_are_refused_by_inspect_and_train(self):
        # dataset.json naming a shard outside its folder ('..', an absolute path, a symlink inside
        # the folder pointing out): nothing is read from there, and the one error line names
        # dataset.json, the entry and where it resolves.
        root = os.path.join(self.tmp, "escape")
        ds, outside = os.path.join(root, "ds"), os.path.join(root, "outside")
        shutil.copytree(self.ds, ds)
        os.makedirs(outside)
        shard = os.path.join(outside, "train_00001.h5")
        shutil.move(os.path.join(ds, "train_00001.h5"), shard)
        meta_file = os.path.join(ds, "dataset.json")
        with open(meta_file) as f:
            meta = json.load(f)

        def entry(name):
            meta["splits"]["train"]["shards"][1] = name
            with open(meta_file, "w") as f:
                json.dump(meta, f)

        real = os.path.realpath(shard)
        entry("../outside/train_00001.h5")
        needles = [meta_file, "key 'splits.train.shards[1]' is '../outside/train_00001.h5'",
                   f"resolves to '{real}', outside the dataset folder"]
        rc, _, err = run("inspect", ds)
        self.assert_one_error_line(rc, err, *needles)
        rc, _, err = run("train", "--config", os.path.join(SRC, "configs", "bev_tiny.yaml"), f"data.path={ds}",
                         f"experiment.output_dir={root}", "train.steps=1", "train.device=cpu",
                         "data.num_workers=0")
        self.assertNotEqual(rc, 0)
        self.assertIn(f"parallax: error: '{meta_file}': key", err)
        for n in needles:
            self.assertIn(n, err)
        entry(shard)
        rc, _, err = run("inspect", ds)
        self.assert_one_error_line(rc, err, meta_file, "key 'splits.train.shards[1]'", f"absolute path '{shard}'")
        entry("train_00001.h5")
        os.symlink(shard, os.path.join(ds, "train_00001.h5"))
        rc, _, err = run("inspect", ds)
        self.assert_one_error_line(rc, err, meta_file, "key 'splits.train.shards[1]' is 'train_00001.h5'",
                                   f"resolves to '{real}', outside the dataset folder")

    def test_jpeg_shards_are_smaller_and_inspect_decodes_every_image(self):
        jd = os.path.join(self.tmp, "jpeg")
        rc, _, err = run("datagen", "--out", jd, "--scenes", "5", "--val-scenes", "2", "--shard-scenes", "3",
                         "--seed", "3", "--image-codec", "jpeg", "--quality", "90", *SMALL)
        if rc != 0 and "this build has no JPEG codec" in err:
            self.skipTest("built without libjpeg-turbo")
        self.assertEqual(rc, 0, err)
        with open(os.path.join(jd, "dataset.json")) as f:
            info = json.load(f)
        self.assertEqual((info["image_codec"], info["jpeg_quality"]), ("jpeg", 90))
        size = lambda d: sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d) if n.endswith(".h5"))
        self.assertLess(size(jd), size(self.ds))
        rc, out, err = run("inspect", jd)
        self.assertEqual(rc, 0, err)
        for s in ("stored as JPEG (quality 90", "000000: images uint8 [3, 40, 64, 3]", "verified: all 5 scenes"):
            self.assertIn(s, out)
        rc, _, err = run("datagen", "--out", os.path.join(self.tmp, "y"), "--scenes", "2", "--image-codec", "png")
        self.assert_one_error_line(rc, err, "--image-codec must be raw or jpeg, got 'png'")

    def test_datagen_errors_are_one_line(self):
        rc, _, err = run("datagen", "--scenes", "2")
        self.assert_one_error_line(rc, err, "--out DIR is required")
        rc, _, err = run("datagen", "--out", self.ds, "--scenes", "2", *SMALL)
        self.assert_one_error_line(rc, err, "already holds a dataset", "--overwrite")
        rc, _, err = run("datagen", "--out", os.path.join(self.tmp, "x"), "--scenes", "2", "--cameras", "0")
        self.assert_one_error_line(rc, err, "--cameras")

    def test_datagen_writes_sequences_that_h5py_and_inspect_read(self):
        sd = os.path.join(self.tmp, "seq")
        rc, _, err = run("datagen", "--out", sd, "--scenes", "7", "--val-scenes", "0", "--shard-scenes", "4",
                         "--sequence-length", "3", "--frame-interval", "0.25", *SMALL)
        self.assertEqual(rc, 0, err)
        with open(os.path.join(sd, "dataset.json")) as f:
            meta = json.load(f)
        self.assertEqual((meta["sequence_length"], meta["frame_interval"]), (3, 0.25))
        import h5py
        import numpy as np
        # Scenes 0..6: sequences of 3, 3 and 1 frames (the last one shorter).
        want = [(0, 0, -1), (0, 1, 0), (0, 2, 1), (1, 0, -1), (1, 1, 3), (1, 2, 4), (2, 0, -1)]
        for i, (seq, frame, prev) in enumerate(want):
            with h5py.File(os.path.join(sd, f"train_{i // 4:05d}.h5"), "r") as f:
                s = f[f"scenes/{i:06d}"]
                a = s.attrs
                self.assertEqual((a["sequence"], a["frame"], a["prev_index"]), (seq, frame, prev))
                self.assertEqual(a["timestamp_us"], frame * 250000)
                k = s["boxes"].shape[0]
                self.assertEqual((s["velocities"].dtype.str, s["velocities"].shape), ("<f4", (k, 2)))
                self.assertEqual((s["instance_ids"].dtype.str, s["instance_ids"].shape), ("<i8", (k,)))
                self.assertEqual((s["ego_to_global"].dtype.str, s["ego_to_global"].shape), ("<f8", (4, 4)))
                self.assertTrue(np.isfinite(s["velocities"][()]).all())
        rc, out, err = run("inspect", sd)
        self.assertEqual(rc, 0, err)
        for line in ("sequences: 3 frames each, 0.25 s apart", "| sequence 0 frame 1 prev 000000 t 250000 us"):
            self.assertIn(line, out)
        rc, out, _ = run("inspect", self.ds)
        self.assertIn("sequences: none declared", out)
        self.assertNotIn("| sequence", out)

    def test_bad_sequence_options_are_one_error_line_each(self):
        out = os.path.join(self.tmp, "seq_bad")
        rc, _, err = run("datagen", "--out", out, "--scenes", "4", "--sequence-length", "0", *SMALL)
        self.assert_one_error_line(rc, err, "--sequence-length", "got 0")
        for v in ("0", "-0.5"):
            rc, _, err = run("datagen", "--out", out, "--scenes", "4", "--sequence-length", "2",
                             "--frame-interval", v, *SMALL)
            self.assert_one_error_line(rc, err, "--frame-interval", "> 0")
        rc, _, err = run("datagen", "--out", out, "--scenes", "4", "--sequence-length", "2",
                         "--frame-interval", "1e-9", *SMALL)
        self.assert_one_error_line(rc, err, "--frame-interval", "1 microsecond")
        rc, _, err = run("datagen", "--out", out, "--scenes", "4", "--sequence-length", "2", "--layout", "nuscenes",
                         "--samples-per-scene", "3", *SMALL)
        self.assert_one_error_line(rc, err, "--samples-per-scene 3 with --sequence-length 2")
        self.assertFalse(os.path.exists(os.path.join(out, "dataset.json")))


if __name__ == "__main__":
    PARALLAX = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
