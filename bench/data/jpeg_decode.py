"""Decodes the JPEGs that `data_bench jpeg --out DIR` wrote with Pillow (and torchvision.io.decode_jpeg
on the CPU where torchvision is installed), on one thread, full size and with Pillow's draft mode (libjpeg's DCT scaling, as `decode_jpeg(..., scale)`): scenes/s per core,
one JSON line per scale, for docs/PERFORMANCE.md beside data_bench's own lines (same files, same run:
bench/data/jpeg_bench.sh).

    python3 bench/data/jpeg_decode.py DIR [--cameras 6] [--repeats 3] [--fit 256x704]
"""
import argparse
import glob
import io
import json
import os
import time

from PIL import Image


def median_rate(fn, data, scenes, repeats):
    """Scenes per second (median over `repeats` passes) of calling fn on every file's bytes."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in data:
            fn(b)
        rates.append(scenes / (time.perf_counter() - t0))
    rates.sort()
    return round(rates[len(rates) // 2], 2)


def pillow_open(b, scale):
    im = Image.open(io.BytesIO(b))
    if scale > 1:
        im.draft("RGB", (im.width // scale, im.height // scale))
    return im.convert("RGB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--cameras", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fit", default="256x704", help="the model's input HxW")
    a = ap.parse_args()
    files = sorted(glob.glob(os.path.join(a.dir, "cam_*.jpg")))
    data = [open(f, "rb").read() for f in files]
    scenes = len(files) / a.cameras
    for scale in (1, 2, 4, 8):
        im = pillow_open(data[0], scale)
        rate = median_rate(lambda b: pillow_open(b, scale).load(), data, scenes, a.repeats)
        print(json.dumps({"bench": "jpeg_decode", "impl": f"Pillow {Image.__version__}", "scale": scale,
                          "decoded": [im.height, im.width], "scenes_per_s_per_core": rate}))
    # To the model's input: decode (full size, or draft at the scale data_bench's loader path picks)
    # and one resize with Pillow's antialiased bilinear filter (the same triangle filter as
    # data::resample). No augmentation on this side.
    fh, fw = (int(v) for v in a.fit.split("x"))
    first = Image.open(io.BytesIO(data[0]))
    dct = next((k for k in (8, 4, 2) if -(-first.height // k) >= fh and -(-first.width // k) >= fw), 1)
    for scale in sorted({1, dct}):
        rate = median_rate(lambda b: pillow_open(b, scale).resize((fw, fh), Image.BILINEAR), data, scenes,
                           a.repeats)
        print(json.dumps({"bench": "jpeg_to_input", "impl": f"Pillow {Image.__version__}", "dct_scale": scale,
                          "augment": False, "to": [fh, fw], "scenes_per_s_per_core": rate}))
    torchvision_rows(data, scenes, a.repeats, fh, fw)


def torchvision_rows(data, scenes, repeats, fh, fw):
    """torchvision.io.decode_jpeg on the CPU (one thread), full size (it has no DCT scaling), and
    + a resize to the model's input (torch's antialiased bilinear interpolate)."""
    try:
        import torch
        import torchvision
        from torchvision.io import decode_jpeg
    except ImportError as e:
        print(json.dumps({"bench": "jpeg_decode", "impl": "torchvision", "skipped": str(e)}))
        return
    torch.set_num_threads(1)
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in data]
    def one(t, resize):
        img = decode_jpeg(t)
        if resize:
            torch.nn.functional.interpolate(img.unsqueeze(0).float(), size=(fh, fw), mode="bilinear",
                                            antialias=True, align_corners=False)

    for resize in (False, True):
        rate = median_rate(lambda t: one(t, resize), tensors, scenes, repeats)
        print(json.dumps({"bench": "jpeg_to_input" if resize else "jpeg_decode",
                          "impl": f"torchvision {torchvision.__version__}", "dct_scale": 1, "augment": False,
                          **({"to": [fh, fw]} if resize else {}), "scenes_per_s_per_core": rate}))


if __name__ == "__main__":
    main()
