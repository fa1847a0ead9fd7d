#!/usr/bin/env python3
"""`parallax eval` end to end through the real binary (issue 22, the eval part; issue 35):

- a tiny generated dataset (7 val scenes: not a multiple of 2, 3 or the batch size 2, so every
  rank count has a partial last batch), bev tiny trained a few steps on 2 ranks with an
  in-training eval and a checkpoint, evaluated on 1, 2 and 3 ranks (mpirun): every reported metric
  and the dumped predictions are the same, and the same as the in-training eval's;
- the dumped predictions and ground truth (nuScenes submission JSON) re-scored by
  tools/nuscenes_score.py give the printed mAP, per-class AP, ATE/ASE/AOE and NDS;
- bad input (no checkpoint there, an unknown split, weights holding NaN, a dump target that cannot
  be written) is one clear error line, and a failed dump leaves no temporary file;
- the outputs never replace what is not theirs (core/files.h): --out is written through a
  character device (null; full: "No space left on device", rc 1, nothing left behind) and a FIFO;
  a directory, a socket, an empty path and, for --dump-predictions (whose _gt and _metrics files
  are named from its path), a device node or FIFO are refused before any work, as is a derived
  file's path taken by one. So is datagen --out that is not a folder.

Usage: test_eval.py <parallax binary> <mpirun>
"""
import json
import math
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import unittest
import zlib

import h5py

PARALLAX = MPIRUN = None
SRC = os.environ.get("PARALLAX_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
BEV = os.path.join(SRC, "configs", "bev_tiny.yaml")
sys.path.insert(0, os.path.join(SRC, "tools"))
import nuscenes_score  # noqa: E402

# Every run: CPU, one intra-op thread (the same kernels whatever the rank count), batches of 2.
COMMON = ["train.device=cpu", "train.threads=1", "data.num_workers=0", "data.batch_size=2"]
VAL_SCENES = 7

# val_loss is a mean of per-scene losses (train/evaluate.h). Each scene's loss is the same
# computation whatever the rank count and batch (the premise, asserted below); only the float64
# sum of the n = 7 positive losses is grouped differently (per rank, then across ranks). Any
# grouping takes n - 1 additions, each rounding by at most u64 = 2^-53 of the total, and the
# division by n one more u64: two such means differ by at most 2 ((n - 1) + 1) u64 = 2 n u64
# relative.
VAL_LOSS_RTOL = 2 * VAL_SCENES * 2.0 ** -53


def same_metrics(test, ref, got, what):
    """Every metric of `ref` in `got`, equal: val_loss within VAL_LOSS_RTOL, the others within
    1e-12 (bitwise on this CPU; the margin leaves room for the last bit of a double mean, seen on
    the GPU image: 1 ulp of 2.7e-3 with another numpy/libm, far below any change a wrong match or
    a lost detection makes, >= 1e-3 of an AP here). null (NaN: a class that never occurs) must be
    null on both sides."""
    test.assertTrue(set(ref) <= set(got), (what, sorted(set(ref) - set(got))))
    for k, a in ref.items():
        b = got[k]
        if a is None or b is None:
            test.assertEqual(a, b, (what, k))
            continue
        tol = VAL_LOSS_RTOL * abs(a) if k == "val_loss" else 1e-12
        test.assertLessEqual(abs(a - b), tol, (what, k, a, b))


def run(args, ranks=1, check=True, timeout=300):
    cmd = [PARALLAX, *args]
    if ranks > 1:
        cmd = [MPIRUN, "--oversubscribe", "--bind-to", "none", "-np", str(ranks), *cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return p


def char_device(path, minor):
    """A character device node (major 1: minor 3 null, 7 full) at `path`, or a skip reason where this
    process may not make one (no CAP_MKNOD) or open it (a nodev mount)."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
        with open(path, "wb"):
            pass
    except OSError as e:
        if os.path.lexists(path):
            os.remove(path)
        return f"cannot make or open a device node here: {e}"
    return None


class FifoReader:
    """Reads a FIFO to its end on a thread (so that a writer's open does not block forever)."""

    def __init__(self, path):
        self.path, self.data = path, None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        with open(self.path, "rb") as f:
            self.data = f.read()

    def close(self):
        try:  # a writer that never came: open the write end once so that the reader sees EOF
            os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        self.thread.join(10)


class EvalTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        d = cls.d = cls.tmp.name
        cls.data = os.path.join(d, "data")
        run(["datagen", "--out", cls.data, "--scenes", "8", "--val-scenes", str(VAL_SCENES), "--cameras",
             "4", "--height", "64", "--width", "112", "--threads", "2", "--samples-per-pixel", "1"])
        cls.cfg = [f"data.path={cls.data}", *COMMON]
        # On 2 ranks, with the trainer's own eval after the last step (the same weights as the
        # final checkpoint).
        run(["train", "--config", BEV, f"experiment.output_dir={d}", "experiment.name=bev", *cls.cfg,
             "train.steps=20", "train.log_every=1", "train.eval_every=20", "schedule.warmup_steps=1",
             "optim.lr=3e-3"], ranks=2)
        cls.ckpt = os.path.join(d, "bev", "checkpoints")
        with open(os.path.join(d, "bev", "metrics.jsonl")) as f:
            cls.train_evals = [r for r in map(json.loads, filter(str.strip, f)) if r["kind"] == "eval"]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def evaluate(self, ranks, name):
        pred = os.path.join(self.d, f"{name}.json")
        p = run(["eval", "--config", BEV, "--checkpoint", self.ckpt, "--dump-predictions", pred,
                 *self.cfg], ranks)
        with open(os.path.join(self.d, f"{name}_metrics.json")) as f:
            doc = json.load(f)
        return p.stdout, doc, pred

    def test_every_metric_is_the_same_on_1_2_3_ranks_and_in_training_and_the_dump_rescores(self):
        # Exact but for val_loss: with one thread, every scene's forward pass is the same
        # computation in any batch (a scene's rows of each kernel do not depend on the others'),
        # the IoU counts are integer sums and the detections are gathered exactly (float32 values
        # carried as float32) and sorted by (score, scene, row), so AP, the errors and IoU are
        # bitwise equal. val_loss: the float64 sum's grouping (VAL_LOSS_RTOL).
        runs = {r: self.evaluate(r, f"r{r}") for r in (1, 2, 3)}
        out1, doc1, pred1 = runs[1]
        m1 = doc1["metrics"]
        for k in ("map", "map_2m", "miou", "ate", "ase", "aoe", "ave", "aae", "nds", "nds_no_aae", "val_loss",
                  "ap_vehicle", "ave_vehicle"):
            self.assertIn(k, m1)
        for r, (_, doc, pred) in runs.items():
            self.assertEqual(doc["ranks"], r)
            # The premise first: the detections (the forward pass's scores and boxes) are bitwise
            # the same whatever batch each scene fell in (measured here also for batches of 1, 3
            # and 7).
            with open(pred1) as f1, open(pred) as f2:
                self.assertEqual(json.load(f1)["results"], json.load(f2)["results"],
                                 f"{r} ranks: the forward pass differs between batch shapes")
            self.assertEqual(sorted(doc["metrics"]), sorted(m1))
            same_metrics(self, m1, doc["metrics"], f"{r} ranks")
        # The trainer's eval (2 ranks) goes through the same code: the same numbers.
        self.assertEqual([r["step"] for r in self.train_evals], [20])
        same_metrics(self, m1, self.train_evals[0], "in-training eval")

        # The printed lines are the JSON's values.
        printed = dict(l.split() for l in out1.splitlines() if len(l.split()) == 2 and l.split()[0] in m1)
        self.assertAlmostEqual(float(printed["map"]), m1["map"], delta=5e-7)  # %.6f

        # Re-scored from the dumped files. AP depends on the same doubles (x, y, score as written
        # with round-trip precision) through the same operations; only hypot may round differently
        # (math.hypot vs glibc, 1 ulp), which changes a match only for a distance within 1 ulp of a
        # threshold. So AP and mAP are equal up to the order of float sums, which is the same: 0.
        # The TP errors use the yaw recovered from the quaternion (atan2 of cos/sin of yaw/2:
        # a few ulp of pi, ~1e-15) and the 1-ulp hypot: running means and linear interpolation
        # keep those below 1e-14 absolute; 1e-12 is a generous bound.
        gt1 = pred1[:-5] + "_gt.json"
        s = nuscenes_score.score(pred1, gt1)
        # Equal on this CPU; 1e-12 as above for another Python/numpy (the same sums in the same order,
        # but Python's float formatting and libm may differ in the last bit).
        self.assertLessEqual(abs(s["map"] - m1["map"]), 1e-12)
        self.assertLessEqual(abs(s["map_at"][2.0] - m1["map_2m"]), 1e-12)
        for c, ap in s["ap"].items():
            self.assertLessEqual(abs(ap - m1[f"ap_{c}"]), 1e-12, c)
            for e in ("ate", "ase", "aoe", "ave"):
                self.assertLessEqual(abs(s["tp"][c][e] - m1[f"{e}_{c}"]), 1e-12, (c, e))
        for e in ("ate", "ase", "aoe", "ave", "aae", "nds", "nds_no_aae"):
            self.assertLessEqual(abs(s[e] - m1[e]), 1e-12, e)
        # NDS is the devkit's formula on these numbers (docs/data.md): no attribute is predicted,
        # so AAE is 1 and its term 0. The same double operations in the same order: equal (1e-15,
        # about 9 ulp of values near 1, is margin only).
        self.assertEqual(m1["aae"], 1.0)
        terms = sum(max(1 - m1[e], 0.0) for e in ("ate", "ase", "aoe", "ave"))
        self.assertLessEqual(abs(m1["nds"] - (5 * m1["map"] + terms) / 10), 1e-15)
        self.assertLessEqual(abs(m1["nds_no_aae"] - (5 * m1["map"] + terms) / 9), 1e-15)
        # The checks above must not pass trivially: detections score AP > 0 and some class has
        # true positives at 2 m (an error of exactly 1 is the no-true-positive convention; ATE is
        # in metres and may exceed 1).
        self.assertGreater(s["map"], 0, s)
        self.assertTrue(any(s["tp"][c]["ate"] != 1.0 for c in s["tp"]), s)

        # The submission format.
        with open(pred1) as f:
            sub = json.load(f)
        self.assertEqual(sorted(sub["results"], key=int), [str(i) for i in range(VAL_SCENES)])
        boxes = [b for v in sub["results"].values() for b in v]
        self.assertTrue(boxes)
        for b in boxes:
            self.assertEqual(len(b["translation"]), 3)
            self.assertEqual(len(b["size"]), 3)
            self.assertAlmostEqual(sum(q * q for q in b["rotation"]), 1.0, delta=1e-12)
            self.assertIn(b["detection_name"], sub["meta"]["classes"])
            self.assertTrue(math.isfinite(b["detection_score"]))

    def test_the_scorer_gives_a_perfect_score_to_the_ground_truth(self):
        # Independent of the binary's numbers: the ground truth scored against itself has AP 1 for
        # every class present and zero errors (exact: every distance, size ratio and angle is 0).
        _, _, pred = self.evaluate(1, "self")
        gt = pred[:-5] + "_gt.json"
        with open(gt) as f:
            doc = json.load(f)
        for v in doc["results"].values():
            for b in v:
                b["detection_score"] = 0.5
        perfect = os.path.join(self.d, "perfect.json")
        with open(perfect, "w") as f:
            json.dump(doc, f)
        s = nuscenes_score.score(perfect, gt)
        present = {b["detection_name"] for v in doc["results"].values() for b in v}
        for c in present:
            # AP in double: 90 terms of (1 - 0.1) summed, divided by 90 and by 0.9: within 64 ulp
            # of 1 (the bound of tests/data/metrics_test.cpp's kApTol).
            self.assertAlmostEqual(s["ap"][c], 1.0, delta=64 * 2.0 ** -53, msg=c)
            e = s["tp"][c]
            self.assertEqual({k: e[k] for k in ("ate", "ase", "aoe")}, {"ate": 0.0, "ase": 0.0, "aoe": 0.0}, c)
            # The ground truth's velocity, where known, is its own prediction's (0); unknown
            # (NaN, written `NaN`) everywhere gives the devkit's all-NaN 1. No attribute: AAE 1.
            vels = [b["velocity"] for v in doc["results"].values() for b in v if b["detection_name"] == c]
            self.assertEqual(e["ave"], 1.0 if all(math.isnan(x) for v in vels for x in v) else 0.0, c)
            self.assertEqual(e["aae"], 1.0, c)

    def nan_weights(self):
        """The run's exported weights with one NaN: (file, tensor name)."""
        run(["export", "--run", os.path.join(self.d, "bev"), "--format", "weights"])
        bad = os.path.join(self.d, "nan_weights.h5")
        shutil.copy(os.path.join(self.d, "bev", "export", "weights.h5"), bad)
        with h5py.File(bad, "r+") as f:
            name = sorted(k for k in f if k.endswith(".weight"))[-1]
            a = f[name][()]
            a.flat[a.size // 2] = float("nan")
            f[name][...] = a
            f[name].attrs["crc32"] = zlib.crc32(a.tobytes())  # every load verifies it
        return bad, name

    def test_bad_input_is_one_clear_error_line(self):
        bad, tensor = self.nan_weights()
        for args, needles in (
            (["--checkpoint", os.path.join(self.d, "nowhere")], ["checkpoint", "nowhere", "does not exist"]),
            (["--checkpoint", self.ckpt, "--split", "tset"], ["split 'tset'", "its splits: train, val"]),
            # Weights holding NaN used to score mIoU 0 with rc 0.
            (["--checkpoint", bad], [f"eval: checkpoint '{bad}': tensor '{tensor}' holds 1 NaN and 0 infinite",
                                     "refusing to evaluate"]),
            # Accepted on the CPU while train refused it: the same refusal, before any work.
            (["--checkpoint", self.ckpt, "precision.mode=fp8"],
             ["key 'precision.mode': fp8 needs an NVIDIA GPU with FP8 tensor cores", "cpu", "precision.mode=bf16"]),
        ):
            p = run(["eval", "--config", BEV, *args, *self.cfg], check=False)
            self.assertNotEqual(p.returncode, 0)
            lines = [l for l in p.stderr.splitlines() if l.strip()]
            self.assertEqual(len(lines), 1, p.stderr)
            self.assertTrue(lines[0].startswith("parallax: error: "), lines[0])
            for n in needles:
                self.assertIn(n, lines[0])

    def one_error(self, p):
        self.assertNotEqual(p.returncode, 0, p.stdout[-2000:])
        errors = [l for l in p.stderr.splitlines() if l.startswith("parallax: error:")]
        self.assertEqual(len(errors), 1, p.stderr[-2000:])
        return errors[0]

    def test_a_refused_dump_target_is_refused_before_work_and_leaves_nothing(self):
        # The predictions' target is a directory: the rename would replace it. It is refused
        # before the evaluation (it left <stem>_metrics.json behind), and nothing is written.
        folder = os.path.join(self.d, "dump")
        os.makedirs(os.path.join(folder, "preds.json"))
        p = run(["eval", "--config", BEV, "--checkpoint", self.ckpt, "--dump-predictions",
                 os.path.join(folder, "preds.json"), *self.cfg], check=False)
        line = self.one_error(p)
        self.assertIn(f"--dump-predictions '{os.path.join(folder, 'preds.json')}' is a directory", line)
        self.assertEqual(sorted(os.listdir(folder)), ["preds.json"])
        self.assertEqual(os.listdir(os.path.join(folder, "preds.json")), [])

    def test_outputs_never_replace_device_nodes_fifos_sockets_or_folders(self):
        """Hostile-user review: --dump-predictions /dev/null (as root) turned /dev/null into a file
        and wrote /dev/null_gt and /dev/null_metrics; /dev/full returned 0. In a temporary folder:
        each refusal is one line naming the option and the path, made before any work (the
        checkpoint named does not exist, and its error does not come first), and leaves the
        folder as it was."""
        d = tempfile.mkdtemp(dir=self.d, prefix="targets_")
        null, full = os.path.join(d, "null"), os.path.join(d, "full")
        skip = char_device(null, 3) or char_device(full, 7)
        if skip:
            self.skipTest(skip)
        fifo = os.path.join(d, "fifo")
        os.mkfifo(fifo)
        sock_path = os.path.join(d, "sock")
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(sock_path)
        self.addCleanup(sock.close)
        folder = os.path.join(d, "folder")
        os.mkdir(folder)
        taken = os.path.join(d, "taken.json")  # a new file whose ground truth's name is a FIFO
        os.mkfifo(os.path.join(d, "taken_gt.json"))
        before = sorted(os.listdir(d))
        nowhere = os.path.join(self.d, "no_checkpoint_here")
        for option, path, words in (
                ("--out", folder, ["is a directory"]),
                ("--out", sock_path, ["is a socket"]),
                ("--out", "", ["empty path"]),
                ("--out", d + "/", ["names a folder"]),
                ("--dump-predictions", null, ["is a character device", "_gt"]),
                ("--dump-predictions", fifo, ["is a FIFO"]),
                ("--dump-predictions", folder, ["is a directory"]),
                ("--dump-predictions", "", ["empty path"]),
                ("--dump-predictions", taken, [f"ground truth file (from --dump-predictions) '{d}/taken_gt.json' "
                                               "is a FIFO"])):
            with self.subTest(option=option, path=path):
                p = run(["eval", "--config", BEV, "--checkpoint", nowhere, option, path, *self.cfg],
                        check=False)
                line = self.one_error(p)
                if path != taken:
                    words = [f"parallax: error: eval: {option} '{path}' ", *words]
                for w in words:
                    self.assertIn(w, line)
                self.assertNotIn("no_checkpoint_here", line)
                self.assertEqual(sorted(os.listdir(d)), before)
        # No two outputs in one file.
        p = run(["eval", "--config", BEV, "--checkpoint", nowhere, "--out", os.path.join(d, "same.json"),
                 "--dump-predictions", os.path.join(d, ".", "same.json"), *self.cfg], check=False)
        self.assertIn("is the same file as eval: --out", self.one_error(p))
        self.assertTrue(stat.S_ISCHR(os.stat(null).st_mode))
        self.assertTrue(stat.S_ISFIFO(os.stat(fifo).st_mode))
        # datagen's --out is a folder: a device node is refused before anything is generated.
        p = run(["datagen", "--out", null, "--scenes", "1"], check=False)
        self.assertIn(f"datagen: --out '{null}' is a character device, not a folder", self.one_error(p))

        # Written through: the metrics JSON to a FIFO (a reader on the other end) beside a dump,
        # and to the null device; the nodes stay what they were and nothing lands beside them.
        dump = os.path.join(d, "dump", "preds.json")
        reader = FifoReader(fifo)
        try:
            run(["eval", "--config", BEV, "--checkpoint", self.ckpt, "--out", fifo, "--dump-predictions", dump,
                 *self.cfg])
        finally:
            reader.close()
        self.assertIn("miou", json.loads(reader.data)["metrics"])
        self.assertEqual(sorted(os.listdir(os.path.dirname(dump))), ["preds.json", "preds_gt.json"])
        run(["eval", "--config", BEV, "--checkpoint", self.ckpt, "--out", null, *self.cfg])
        self.assertTrue(stat.S_ISCHR(os.stat(null).st_mode))
        self.assertTrue(stat.S_ISFIFO(os.stat(fifo).st_mode))
        self.assertEqual(sorted(os.listdir(d)), sorted(before + ["dump"]))

        # The full device: rc 1, one line naming the option, the path and the cause; no predictions
        # or ground truth are left (every file or none).
        dump = os.path.join(d, "full_dump", "preds.json")
        p = run(["eval", "--config", BEV, "--checkpoint", self.ckpt, "--out", full, "--dump-predictions", dump,
                 *self.cfg], check=False)
        line = self.one_error(p)
        self.assertEqual(p.returncode, 1)
        for w in (f"eval: --out '{full}'", "No space left on device"):
            self.assertIn(w, line)
        self.assertFalse(os.path.exists(os.path.dirname(dump)))  # the folder it made is gone too
        self.assertTrue(stat.S_ISCHR(os.stat(full).st_mode))

    def test_help(self):
        p = run(["eval", "--help"])
        for s in ("--checkpoint PATH", "--dump-predictions FILE", "--split NAME", "examples:"):
            self.assertIn(s, p.stdout)


if __name__ == "__main__":
    PARALLAX, MPIRUN = sys.argv[1], sys.argv[2]
    unittest.main(argv=sys.argv[:1], verbosity=2)
