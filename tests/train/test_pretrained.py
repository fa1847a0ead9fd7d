"""Pretrained weights from PyTorch (issue 60): timm's ViT-B/16, DINOv2 with registers (timm's
names, its own release's, transformers'), torchvision's ResNet-50, saved as safetensors (one file,
a sharded set) and torch.save, loaded into Parallax's backbones; the backbone's output compared
with the PyTorch model's own; the safetensors export loaded back by timm; hostile files refused
with one line through `parallax train`.

The PyTorch side runs in the bridge venv (torch + torchvision + timm, which cannot live beside the
LibTorch Parallax builds against: scripts/setup.sh, PARALLAX_BRIDGE_PYTHON).

Tolerance of the output comparisons (fp32 both sides, the same weights and images): the two sides
compute the same functions with different summation orders (oneDNN/MKL GEMMs of LibTorch 2.13
against the bridge's torch, SDPA kernels, the patch embedding as a GEMM here and a convolution
there). Each GEMM output with K terms carries a relative rounding error of about sqrt(K) * 2^-24
(random-sign accumulation; K <= 4 * 768 here: <= 3.3e-6); a block adds a few such errors to the
residual stream (LayerScale and LayerNorm keep the stream's scale near 1), so after 12 blocks and
the final LayerNorm (which divides by a standard deviation of ~1) the difference stays near
12 * 4 * 3.3e-6 ~ 1.6e-4 of the output's scale. The bound is 1e-3 of the largest |reference|
value: 6x that estimate, and far below the changes a wrong mapping makes (a missing LayerScale,
a transposed qkv, an unfolded class position, a wrong interpolation: all O(1), checked below by
loading a deliberately wrong file).
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PARALLAX = TOOL = None
SRC = os.environ.get("PARALLAX_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
SIDE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_side.py")
BRIDGE = os.environ.get("PARALLAX_BRIDGE_PYTHON",
                        os.path.expanduser("~/.cache/parallax/bridge-venv/bin/python3"))
RTOL = 1e-3  # of max |reference|; see the module docstring


def bridge(*args):
    r = subprocess.run([BRIDGE, SIDE, *map(str, args)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise AssertionError(f"torch_side {' '.join(map(str, args))} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def tool(backbone, h, w, weights, io, out, *extra):
    cmd = [TOOL, "--backbone", backbone, "--height", str(h), "--width", str(w), "--weights",
           weights, "--images", io, "--out", out, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def report_counts(stdout):
    counts = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[-1].isdigit() and line.startswith("  ") and ":" not in line:
            counts[" ".join(parts[:-1])] = int(parts[-1])
    return counts


class PretrainedTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="parallax_pretrained_")
        cls.dir = cls.tmp.name

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def fixture(self, kind, name, h, w, *flags):
        d = os.path.join(self.dir, f"{name}_{h}x{w}")
        if not os.path.isdir(d):
            os.makedirs(d)
            bridge(kind, name, h, w, d, *flags)
        return d

    def compare(self, backbone, h, w, weights, io, *extra, key="tokens"):
        out = os.path.join(self.dir, "out.safetensors")
        r = tool(backbone, h, w, weights, io, out, *extra)
        self.assertEqual(r.returncode, 0, r.stderr)
        got = load_file(out)[key]
        ref = load_file(io)["ref"]
        self.assertEqual(tuple(got.shape), tuple(ref.shape))
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        self.assertLess(err, RTOL, f"{backbone} from {os.path.basename(weights)}: {err:.3g}")
        return r.stdout, err

    def test_vit_b16_from_timm(self):
        d = self.fixture("vit", "vit_base_patch16_224", 224, 224)
        io = os.path.join(d, "io.safetensors")
        for f in ("model.safetensors", "model.pt"):
            out, err = self.compare("vit_base_patch16", 224, 224, os.path.join(d, f), io,
                                    "--source", "timm")
            counts = report_counts(out)
            # 150 ViT tensors (12 blocks x 12, patch embedding 2, class token and position embedding,
            # norm 2); the head's two
            # are ignored, nothing missing or unexpected.
            self.assertEqual(counts.get("loaded"), 150, out)
            self.assertEqual(counts.get("ignored"), 2, out)
            self.assertEqual(counts.get("missing"), 0, out)
            self.assertEqual(counts.get("unexpected"), 0, out)
        # A sharded set with its index loads the same values: the same output, bitwise.
        shards = os.path.join(self.dir, "vit_b16_sharded")
        bridge("shard", os.path.join(d, "model.safetensors"), shards)
        a = os.path.join(self.dir, "a.safetensors")
        b = os.path.join(self.dir, "b.safetensors")
        for weights, out in ((os.path.join(d, "model.safetensors"), a), (shards, b)):
            r = tool("vit_base_patch16", 224, 224, weights, io, out, "--source", "timm")
            self.assertEqual(r.returncode, 0, r.stderr)
        self.assertTrue(torch.equal(load_file(a)["tokens"], load_file(b)["tokens"]))

    def test_resnet50_from_torchvision(self):
        # torchvision's resnet50 (BN statistics randomised) against the model.backbone=resnet50
        # trunk with its frozen batch norms, at 128 x 224: every name maps one to one (318 tensors
        # loaded, fc's two ignored). Tolerance: the module docstring's bound; a 53-convolution trunk
        # of K <= 4608 terms stays far inside it (the norms are fixed affine maps; measured 1.3e-6).
        d = self.fixture("resnet", "resnet50", 128, 224)
        io = os.path.join(d, "io.safetensors")
        for f in ("model.safetensors", "model.pt"):
            out, err = self.compare("resnet50", 128, 224, os.path.join(d, f), io,
                                    "--source", "torchvision", key="features")
            counts = report_counts(out)
            self.assertEqual(counts.get("loaded"), 318, out)
            self.assertEqual(counts.get("ignored"), 2, out)
            self.assertEqual(counts.get("missing"), 0, out)
            self.assertEqual(counts.get("unexpected"), 0, out)
            print(f"tolerance: resnet50 from {f}: {err:.3g} of max |ref|, bound {RTOL}", file=sys.stderr)

    def test_dinov2_registers_at_256x704(self):
        # Patch 14: the 256 x 704 image is padded to 266 x 714 (19 x 51 patches), the 37 x 37
        # position grid resampled to it once at load; timm resamples it in every forward
        # (dynamic_img_size, dynamic_img_pad).
        name = "vit_small_patch14_reg4_dinov2"
        d = self.fixture("vit", name, 256, 704, "--fb")
        io = os.path.join(d, "io.safetensors")
        out, _ = self.compare(name, 256, 704, os.path.join(d, "model.safetensors"), io,
                              "--source", "timm")
        self.assertIn("37x37 -> 19x51", out)
        # DINOv2's own release (torch.save): register_tokens, the class position in pos_embed.
        out, _ = self.compare(name, 256, 704, os.path.join(d, "fb.pth"), io, "--source", "timm")
        self.assertIn("folded", out)
        # Without LayerScale (the plain ViT-S/14 shape is not offered: its absence must show):
        # the same file into the DINOv2 without registers is refused as a mismatch, not loaded.
        r = tool("vit_small_patch14_dinov2", 256, 704, os.path.join(d, "model.safetensors"), io,
                 os.path.join(self.dir, "x.safetensors"), "--source", "timm", "--strict")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("reg_token", r.stderr)

    def test_dinov2_from_transformers(self):
        # transformers' Dinov2WithRegistersModel: its names (query, key and value concatenated
        # into qkv, layer_scale*.lambda1, the class position folded into the class token).
        d = self.fixture("hf_dinov2", "hf_dinov2", 224, 224)
        out, _ = self.compare("vit_small_patch14_reg4_dinov2", 224, 224,
                              os.path.join(d, "model.safetensors"),
                              os.path.join(d, "io.safetensors"), "--source", "hf", "--strict")
        self.assertIn("folded", out)

    def test_vit_from_transformers(self):
        # transformers' ViTModel (google/vit's layout): layernorm_before/after, intermediate and
        # output dense layers, the pooler ignored.
        d = self.fixture("hf_vit", "hf_vit", 224, 224)
        self.compare("vit_small_patch16", 224, 224, os.path.join(d, "model.safetensors"),
                     os.path.join(d, "io.safetensors"), "--source", "hf", "--strict")

    def test_dinov2_without_registers(self):
        name = "vit_small_patch14_dinov2"
        d = self.fixture("vit", name, 224, 224)
        self.compare(name, 224, 224, os.path.join(d, "model.pt"), os.path.join(d, "io.safetensors"),
                     "--source", "timm")
        # Its patch-14 embedding into a patch-16 ViT: refused with both sizes named.
        r = tool("vit_small_patch16", 224, 224, os.path.join(d, "model.pt"),
                 os.path.join(d, "io.safetensors"), os.path.join(self.dir, "x.safetensors"),
                 "--source", "timm")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("(patch 14), the model's patch is 16", r.stderr)

    def test_wrong_mapping_is_caught(self):
        # The comparison can fail: the ViT-B/16 weights with two blocks' qkv swapped give another
        # output, far outside the bound.
        d = self.fixture("vit", "vit_base_patch16_224", 224, 224)
        state = load_file(os.path.join(d, "model.safetensors"))
        state["blocks.3.attn.qkv.weight"], state["blocks.4.attn.qkv.weight"] = (
            state["blocks.4.attn.qkv.weight"], state["blocks.3.attn.qkv.weight"])
        bad = os.path.join(self.dir, "swapped.safetensors")
        save_file(state, bad)
        out = os.path.join(self.dir, "out.safetensors")
        r = tool("vit_base_patch16", 224, 224, bad, os.path.join(d, "io.safetensors"), out,
                 "--source", "timm")
        self.assertEqual(r.returncode, 0, r.stderr)
        ref = load_file(os.path.join(d, "io.safetensors"))["ref"]
        err = (load_file(out)["tokens"] - ref).abs().max().item() / ref.abs().max().item()
        self.assertGreater(err, 100 * RTOL)


class PretrainedTrainTest(unittest.TestCase):
    """Through `parallax train` / `parallax export`: a ViT-S/16 from timm into the bev model at the
    synthetic scene's 128 x 224 (8 x 14 patches), the load row, the round trip back into timm,
    and hostile files."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="parallax_pretrained_train_")
        cls.dir = cls.tmp.name
        cls.src = os.path.join(cls.dir, "vits")
        os.makedirs(cls.src)
        bridge("vit", "vit_small_patch16_224", 224, 224, cls.src)
        cls.good = os.path.join(cls.src, "model.safetensors")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def train(self, name, load_from, *overrides, steps=1):
        cmd = [PARALLAX, "train", "--config", os.path.join(SRC, "configs", "bev_tiny.yaml"),
               "model.backbone=vit_small_patch16", "data.synthetic=true", "data.batch_size=1",
               f"train.steps={steps}", "train.log_every=1", "train.eval_every=0",
               f"experiment.output_dir={self.dir}", f"experiment.name={name}",
               f"train.load_from={load_from}", "model.pretrained.source=timm",
               "model.pretrained.target=backbone", *overrides]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)

    def test_load_row_and_round_trip_into_timm(self):
        r = self.train("rt", self.good)
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        with open(os.path.join(self.dir, "rt", "metrics.jsonl")) as f:
            rows = [json.loads(l) for l in f]
        load = [x for x in rows if x["kind"] == "load"]
        self.assertEqual(len(load), 1, rows[:3])
        self.assertEqual(load[0]["format"], "safetensors")
        self.assertEqual(load[0]["loaded"], 150)
        self.assertEqual(sorted(load[0]["ignored"]), ["head.bias", "head.weight"])
        self.assertEqual(load[0]["missing"], [])
        self.assertTrue(any("14x14 -> 8x14" in a for a in load[0]["adapted"]), load[0])
        # Out: the backbone with timm's names, loaded by timm strictly at the run's image size,
        # computes what Parallax's backbone computes with the run's whole-model export.
        run = os.path.join(self.dir, "rt")
        for extra in ([], ["--convention", "timm"]):
            r = subprocess.run([PARALLAX, "export", "--run", run, "--format", "safetensors",
                                *extra], capture_output=True, text=True, timeout=600)
            self.assertEqual(r.returncode, 0, r.stderr)
        exported = os.path.join(run, "export", "backbone.timm.safetensors")
        whole = os.path.join(run, "export", "model.safetensors")
        io = os.path.join(self.dir, "io128.safetensors")
        save_file({"images": torch.randn(2, 3, 128, 224, generator=torch.Generator().manual_seed(5))},
                  io)
        ref = os.path.join(self.dir, "timm128.safetensors")
        bridge("timm_load", "vit_small_patch16_224", 128, 224, exported, io, ref)
        save_file({"images": load_file(io)["images"], "ref": load_file(ref)["tokens"]}, io)
        out = os.path.join(self.dir, "p128.safetensors")
        r = tool("vit_small_patch16", 128, 224, whole, io, out, "--source", "parallax",
                 "--strict")
        self.assertEqual(r.returncode, 0, r.stderr)
        got, want = load_file(out)["tokens"], load_file(io)["ref"]
        err = (got - want).abs().max().item() / want.abs().max().item()
        self.assertLess(err, RTOL)

    def test_resnet50_through_train_and_back_into_torchvision(self):
        # torchvision's resnet50 file into `parallax train` (model.backbone=resnet50), one step,
        # then the trunk out with torchvision's names: torchvision loads it strictly (fc replaced
        # by Identity) and computes what Parallax's trunk computes from the run's own export.
        src = os.path.join(self.dir, "r50")
        if not os.path.isdir(src):
            os.makedirs(src)
            bridge("resnet", "resnet50", 128, 224, src)
        r = self.train("r50run", os.path.join(src, "model.pt"), "model.backbone=resnet50",
                       "model.pretrained.source=torchvision")
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        run = os.path.join(self.dir, "r50run")
        for extra in ([], ["--convention", "torchvision"]):
            r = subprocess.run([PARALLAX, "export", "--run", run, "--format", "safetensors",
                                *extra], capture_output=True, text=True, timeout=600)
            self.assertEqual(r.returncode, 0, r.stderr)
        io = os.path.join(src, "io.safetensors")
        ref = os.path.join(self.dir, "tv128.safetensors")
        bridge("tv_load", "resnet50", os.path.join(run, "export", "backbone.torchvision.safetensors"),
               io, ref)
        io2 = os.path.join(self.dir, "io_r50.safetensors")
        save_file({"images": load_file(io)["images"], "ref": load_file(ref)["features"]}, io2)
        out = os.path.join(self.dir, "p_r50.safetensors")
        r = tool("resnet50", 128, 224, os.path.join(run, "export", "model.safetensors"), io2, out,
                 "--source", "parallax", "--strict")
        self.assertEqual(r.returncode, 0, r.stderr)
        got, want = load_file(out)["features"], load_file(io2)["ref"]
        err = (got - want).abs().max().item() / want.abs().max().item()
        self.assertLess(err, RTOL)

    def test_torch_reference_loads_the_whole_model(self):
        # bench/train/torch_bev_ref.py mirrors the bev model with the ViT preset backbone in plain
        # torch.nn with Parallax's names: the whole-model export loads into it with strict=True.
        cmd = [PARALLAX, "train", "--config", os.path.join(SRC, "configs", "bev_tiny.yaml"),
               "model.backbone=vit", "data.synthetic=true", "data.batch_size=1", "train.steps=1",
               "train.eval_every=0", f"experiment.output_dir={self.dir}", "experiment.name=whole"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        run = os.path.join(self.dir, "whole")
        r = subprocess.run([PARALLAX, "export", "--run", run, "--format", "safetensors"],
                           capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stderr)
        ref = os.path.join(SRC, "bench", "train", "torch_bev_ref.py")
        r = subprocess.run([BRIDGE, ref, "--device", "cpu", "--size", "tiny", "--scene", "default",
                            "--batch", "1", "--warmup", "0", "--iters", "1", "--window", "1",
                            "--weights", os.path.join(run, "export", "model.safetensors")],
                           capture_output=True, text=True, timeout=600)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        self.assertIn('"step_ms"', r.stdout)
        # The same file as a LoRA base and as a distillation teacher (whole models, Parallax's
        # names, strict).
        whole = os.path.join(run, "export", "model.safetensors")
        for name, extra, says in (
                ("lora", ["lora.rank=4", "lora.alpha=8", f"lora.base={whole}"], "lora.base="),
                ("dist", [f"distill.teacher={whole}", "distill.teacher_backbone=vit"],
                 "distill.teacher=")):
            r = subprocess.run(cmd[:-1] + [f"experiment.name={name}", *extra],
                               capture_output=True, text=True, timeout=600)
            self.assertEqual(r.returncode, 0, r.stderr[-2000:])
            line = [l for l in r.stderr.splitlines() if says in l]
            self.assertTrue(line and "loaded 65" in line[0] and "missing" not in line[0],
                            r.stderr[-2000:])

    def refused(self, name, path, *overrides, says=None):
        r = self.train(name, path, *overrides)
        self.assertNotEqual(r.returncode, 0, f"{name}: {path} was accepted")
        errors = [l for l in r.stderr.splitlines() if l.startswith("parallax: error:")]
        self.assertEqual(len(errors), 1, r.stderr[-2000:])
        self.assertIn(says or os.path.basename(path), errors[0])
        self.assertFalse(os.path.exists(os.path.join(self.dir, name, "checkpoints", "latest")))
        return errors[0]

    def hostile(self, name, data):
        path = os.path.join(self.dir, name + ".safetensors")
        with open(path, "wb") as f:
            f.write(data)
        return path

    def test_hostile_files(self):
        with open(self.good, "rb") as f:
            raw = f.read()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        body = raw[8 + n:]

        def with_header(h):
            text = json.dumps(h).encode()
            return struct.pack("<Q", len(text)) + text + body

        self.refused("truncated", self.hostile("truncated", raw[:len(raw) // 2]))
        names = sorted(k for k in header if k != "__metadata__")
        h = json.loads(json.dumps(header))
        a, b = h[names[0]]["data_offsets"], h[names[1]]["data_offsets"]
        if a[0] < b[0]:
            a, b = b, a
        b_len = b[1] - b[0]
        b[0], b[1] = a[0], a[0] + b_len  # overlaps a (same length: only the overlap is wrong)
        self.refused("overlap", self.hostile("overlap", with_header(h)))
        h = json.loads(json.dumps(header))
        h[names[0]]["data_offsets"][1] = len(body) + 64
        self.refused("past_end", self.hostile("past_end", with_header(h)))
        self.refused("big_header",
                     self.hostile("big_header", struct.pack("<Q", len(raw) + 100) + raw[8:]))
        state = load_file(self.good)
        bad = dict(state)
        bad["blocks.0.attn.qkv.weight"] = bad["blocks.0.attn.qkv.weight"].to(torch.int32)
        path = os.path.join(self.dir, "int.safetensors")
        save_file(bad, path)
        self.refused("int", path, says="cannot take")
        bad = dict(state)
        w = bad["blocks.1.mlp.fc1.weight"].clone()
        w[3, 5] = float("nan")
        bad["blocks.1.mlp.fc1.weight"] = w
        path = os.path.join(self.dir, "nan.safetensors")
        save_file(bad, path)
        self.refused("nan", path, says="NaN")
        marker = os.path.join(self.dir, "pwned")

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        path = os.path.join(self.dir, "evil.pt")
        torch.save({"w": torch.zeros(2), "x": Evil()}, path)
        self.refused("evil", path)
        self.assertFalse(os.path.exists(marker))
        self.refused("rule", self.good, "model.pretrained.rules=['^nomatch[.] -> x.']",
                     says="model.pretrained.rules[0]")
        self.refused("prefix", self.good, "model.pretrained.prefix=backbone.",
                     says="model.pretrained.prefix")


def main():
    global PARALLAX, TOOL
    PARALLAX, TOOL = sys.argv[1], sys.argv[2]
    del sys.argv[1:3]
    if not os.path.exists(BRIDGE):
        sys.exit(f"test_pretrained: the bridge Python {BRIDGE} (torch + torchvision + timm) is "
                 "missing: run scripts/setup.sh")
    unittest.main(verbosity=2)


if __name__ == "__main__":
    main()
