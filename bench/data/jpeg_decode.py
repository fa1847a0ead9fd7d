"""Decodes the JPEGs that `data_bench jpeg --out DIR` wrote with Pillow, on one thread, full size and
with Pillow's draft mode (libjpeg's DCT scaling, as `decode_jpeg(..., scale)`): scenes/s per core,
one JSON line per scale, for docs/PERFORMANCE.md beside data_bench's own lines (same files, same run:
bench/data/jpeg_bench.sh).

    python3 bench/data/jpeg_decode.py DIR [--cameras 6] [--repeats 3]
"""
import argparse
import glob
import json
import os
import time

from PIL import Image


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--cameras", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    files = sorted(glob.glob(os.path.join(a.dir, "cam_*.jpg")))
    data = [open(f, "rb").read() for f in files]
    scenes = len(files) / a.cameras
    import io
    for scale in (1, 2, 4, 8):
        rates, size = [], None
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for b in data:
                im = Image.open(io.BytesIO(b))
                if scale > 1:
                    im.draft("RGB", (im.width // scale, im.height // scale))
                im = im.convert("RGB")
                im.load()
                size = (im.height, im.width)
            rates.append(scenes / (time.perf_counter() - t0))
        rates.sort()
        print(json.dumps({"bench": "jpeg_decode", "impl": f"Pillow {Image.__version__}", "scale": scale,
                          "decoded": list(size), "scenes_per_s_per_core": round(rates[len(rates) // 2], 2)}))


if __name__ == "__main__":
    main()
