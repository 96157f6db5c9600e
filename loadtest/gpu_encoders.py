"""GPU check of the encoders (issue 13), for a session that is lent a GPU: one short script.

1. decode: nvJPEG batch decode (``gpu_decode.decode_images_gpu``) vs CPU decode
   (``media.decode_image``, one thread and one per core) on the same seeded JPEGs, images/s
   side by side, and the GPU vs CPU pixel difference (max and mean |diff|).
2. tower: ``VisionTower`` images/s on CUDA (random weights): the demo tower and SigLIP-base and
   SigLIP-so400m geometries, float32 and bfloat16.
3. end to end: ``MediaEncoder`` (decode + preprocess + demo tower) on CUDA vs CPU, images/s.

    python loadtest/gpu_encoders.py [--count 64] [--batch 32]

Exits 0 with a "no CUDA" line when there is no GPU (and skips part 1 without nvImageCodec:
pip install nvidia-nvimgcodec-cu12).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from bench_media import make_jpegs  # loadtest/ is the script's directory

from encoders.encode import load_media_encoder
from encoders.gpu_decode import decode_images_gpu, gpu_available
from encoders.media import MediaLimits, decode_image
from encoders.vision import VisionTower, init_tower, save_tower
from encoders.vision_config import VisionConfig, demo_vision_config

SIZES, COUNT, BATCH, REPEATS, SEED = ((640, 480), (1920, 1080)), 64, 32, 5, 0
LIMITS = MediaLimits()
DEVICE = "cuda"
SIGLIP_BASE = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, image_size=224, patch_size=16, merge_size=2,
                   out_hidden_size=4096)
SIGLIP_SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                     num_attention_heads=16, image_size=384, patch_size=14, merge_size=3,
                     out_hidden_size=4096)


def best_s(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """Best wall time of ``fn`` (after one warm-up), CUDA work included."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def decode_cpu(data: bytes) -> np.ndarray:
    return decode_image(data, LIMITS)


def check_decode(count: int) -> None:
    if not gpu_available():
        print("decode: skipped: nvidia.nvimgcodec is not importable "
              "(pip install nvidia-nvimgcodec-cu12)")
        return
    threads = os.cpu_count() or 1
    print(f"{'size':>10} {'cpu 1 thr img/s':>16} {f'cpu {threads} thr img/s':>17} "
          f"{'nvJPEG img/s':>13} {'vs 1 thr':>9} {'vs all':>7} {'max|d|':>7} {'mean|d|':>8}")
    with ThreadPoolExecutor(threads) as pool:
        for w, h in SIZES:
            datas = make_jpegs(w, h, count, 90, SEED)
            one = best_s(lambda d=datas: [decode_cpu(x) for x in d])
            many = best_s(lambda d=datas: list(pool.map(decode_cpu, d)))
            gpu = best_s(lambda d=datas: decode_images_gpu(d, DEVICE, LIMITS))
            diffs = [np.abs(g.cpu().numpy().astype(np.int16) - decode_cpu(data))
                     for g, data in zip(decode_images_gpu(datas, DEVICE, LIMITS), datas)]
            print(f"{f'{w}x{h}':>10} {count / one:>16.1f} {count / many:>17.1f} "
                  f"{count / gpu:>13.1f} {one / gpu:>8.2f}x {many / gpu:>6.2f}x "
                  f"{max(int(d.max()) for d in diffs):>7} "
                  f"{float(np.mean([d.mean() for d in diffs])):>8.3f}")


def check_tower(batch: int) -> None:
    print(f"{'tower':>8} {'dtype':>9} {'batch':>5} {'tok/img':>7} {'img/s':>9}")
    for name, cfg in (("demo", demo_vision_config(64)), ("base", VisionConfig(**SIGLIP_BASE)),
                      ("so400m", VisionConfig(**SIGLIP_SO400M))):
        weights = init_tower(cfg)  # NOTE: CPU randn once per geometry (so400m: ~1.7 GB)
        for dtype in (torch.float32, torch.bfloat16):
            with torch.device("meta"):
                tower = VisionTower(cfg)
            state = {k: v.to(DEVICE, dtype) for k, v in weights.items()}
            tower.load_state_dict(state, assign=True)
            x = torch.randn(batch, 3, cfg.image_size, cfg.image_size, device=DEVICE)
            with torch.inference_mode():
                s = best_s(lambda t=tower, x=x: t(x))
            print(f"{name:>8} {str(dtype)[6:]:>9} {batch:>5} {cfg.tokens_per_image:>7} "
                  f"{batch / s:>9.1f}")
            del tower, state


def check_end_to_end(count: int) -> None:
    datas = make_jpegs(640, 480, count, 90, SEED)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = demo_vision_config(64)
        save_tower(init_tower(cfg), tmp, config=cfg)
        rates = {}
        for device in ("cpu", DEVICE):
            enc = load_media_encoder(tmp, device=device)
            assert enc is not None
            rates[device] = count / best_s(lambda e=enc: e(datas), repeats=3)
            print(f"MediaEncoder on {device} ({'nvJPEG' if enc.is_gpu_decode else 'CPU'} "
                  f"decode): {rates[device]:.1f} images/s (640x480 JPEG, demo tower)")
    print(f"summary: MediaEncoder cuda vs cpu: {rates[DEVICE] / rates['cpu']:.2f}x images/s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=COUNT, help="JPEGs per size")
    ap.add_argument("--batch", type=int, default=BATCH, help="tower batch")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: torch.cuda.is_available() is False; nothing to check on this machine")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    check_decode(args.count)
    check_tower(args.batch)
    check_end_to_end(args.count)
    return 0


if __name__ == "__main__":
    sys.exit(main())
