"""CPU image decode throughput (issue 13): ``encoders.media.decode_image`` (simplejpeg, i.e.
libjpeg-turbo, for JPEG) vs Pillow (``Image.open(...).convert("RGB")`` + ``np.asarray``), side by
side on the same seeded photo-like JPEGs, one thread each.

    python loadtest/bench_media.py [--sizes 256x256,640x480,1920x1080] [--count 32]
        [--repeats 5] [--quality 90]

The two decoders alternate within each repeat (so both see the same box load) and each keeps its
best repeat. One row per size (images/s, MP/s, ratio), then one summary line (geometric mean).
"""

from __future__ import annotations

import argparse
import io
import math
import time
from collections.abc import Callable

import numpy as np
from PIL import Image

from encoders.media import MediaLimits, decode_image

SIZES, COUNT, REPEATS, QUALITY, SEED = "256x256,640x480,1920x1080", 32, 5, 90, 0
LIMITS = MediaLimits()


def make_jpegs(width: int, height: int, count: int, quality: int, seed: int) -> list[bytes]:
    """Smooth gradients, a few blocks and mild noise: compresses like a photo, unlike noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for _ in range(count):
        a, b, c = rng.uniform(0.5, 3.0, 3)
        img = np.stack([127 + 100 * np.sin(a * x / width * 6 + b),
                        127 + 100 * np.cos(b * y / height * 6 + c),
                        127 + 100 * np.sin(c * (x + y) / (width + height) * 6 + a)], -1)
        for _ in range(6):
            x0, y0 = rng.integers(0, width), rng.integers(0, height)
            img[y0:y0 + height // 5, x0:x0 + width // 5] = rng.uniform(0, 255, 3)
        img += rng.normal(0, 6, img.shape)
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def decode_pillow(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def decode_ours(data: bytes) -> np.ndarray:
    return decode_image(data, LIMITS)


def best_seconds(decoders: dict[str, Callable[[bytes], np.ndarray]], datas: list[bytes],
                 repeats: int) -> dict[str, float]:
    best = dict.fromkeys(decoders, math.inf)
    for r in range(repeats):
        for name in list(decoders)[:: 1 if r % 2 == 0 else -1]:  # NOTE: alternate who goes first
            start = time.perf_counter()
            for data in datas:
                decoders[name](data)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=SIZES, help="WxH,... (default: %(default)s)")
    ap.add_argument("--count", type=int, default=COUNT, help="JPEGs per size")
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--quality", type=int, default=QUALITY)
    args = ap.parse_args()
    decoders = {"ours": decode_ours, "pillow": decode_pillow}
    print(f"{'size':>10} {'images':>6} {'ours img/s':>11} {'ours MP/s':>10} "
          f"{'pillow img/s':>13} {'pillow MP/s':>12} {'ratio':>6}")
    ratios = []
    for size in args.sizes.split(","):
        w, h = (int(v) for v in size.split("x"))
        datas = make_jpegs(w, h, args.count, args.quality, SEED)
        ours, ref = decode_ours(datas[0]), decode_pillow(datas[0])
        assert ours.shape == ref.shape == (h, w, 3), (ours.shape, ref.shape)
        best = best_seconds(decoders, datas, args.repeats)
        ips = {name: len(datas) / s for name, s in best.items()}
        mps = {name: v * w * h / 1e6 for name, v in ips.items()}
        ratios.append(ips["ours"] / ips["pillow"])
        print(f"{size:>10} {len(datas):>6} {ips['ours']:>11.1f} {mps['ours']:>10.1f} "
              f"{ips['pillow']:>13.1f} {mps['pillow']:>12.1f} {ratios[-1]:>5.2f}x")
    mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"summary: decode_image (simplejpeg) vs Pillow: {mean:.2f}x images/s "
          f"(geometric mean over {len(ratios)} sizes, best of {args.repeats})")


if __name__ == "__main__":
    main()
