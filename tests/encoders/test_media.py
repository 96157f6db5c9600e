"""``encoders.media`` / ``video`` / ``gpu_decode`` on real media made here by Pillow and PyAV:
every supported format and mode decodes to the same RGB pixels as an independent decode, anything
broken or oversized is a ``MediaError`` (bombs refused from the header, before decoding), the
preprocessing math matches a separate computation, and clips give uniformly sampled frames."""

from __future__ import annotations

import hashlib
import io
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from encoders.media import (
    MediaError,
    MediaLimits,
    content_hash,
    decode_image,
    preprocess,
    preprocess_id,
    probe_image,
)
from encoders.video import decode_clip, probe_clip
from tests.encoders.clips import make_clip

ROOT = Path(__file__).resolve().parents[2]
LIMITS = MediaLimits()
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
BOMB_S = 0.1  # a refused bomb never decodes: far under what decoding 900 MP would take


def _make_photo(width: int = 64, height: int = 48, seed: int = 0) -> np.ndarray:
    yy, xx = np.mgrid[0:height, 0:width]
    rgb = np.stack([xx * 255 / width, yy * 255 / height, (xx + yy) * 255 / (width + height)], -1)
    noise = np.random.default_rng(seed).normal(0, 12, rgb.shape)
    return np.clip(rgb + noise, 0, 255).astype(np.uint8)


def _encode(im: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **params)
    return buf.getvalue()


def _source(mode: str) -> Image.Image:
    photo = Image.fromarray(_make_photo())
    if mode == "I;16":  # a 16-bit grayscale PNG
        return Image.fromarray(_make_photo()[:, :, 0].astype(np.uint16) * 257)
    if mode == "RGBA":
        alpha = Image.fromarray(np.tile(np.arange(64, dtype=np.uint8) * 4, (48, 1)))
        return Image.merge("RGBA", (*photo.split(), alpha))
    return photo.quantize(16) if mode == "P" else photo.convert(mode)


def _expected_rgb(im: Image.Image) -> np.ndarray:
    if im.mode == "I;16":
        gray = (np.asarray(im) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    return np.asarray(im.convert("RGB"))


def _assert_close(got: np.ndarray, want: np.ndarray, max_diff: float, what: str) -> None:
    assert got.shape == want.shape and got.dtype == np.uint8, (what, got.shape, got.dtype)
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert diff.max() <= max_diff, f"{what}: max |diff| {diff.max()} > {max_diff}"


def _assert_refused(data: bytes, *words: str, limits: MediaLimits = LIMITS) -> None:
    with pytest.raises(MediaError) as info:
        decode_image(data, limits)
    assert all(w in info.value.reason for w in words), (words, info.value.reason)


LOSSLESS = [("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "P"), ("PNG", "L"), ("PNG", "1"),
            ("PNG", "LA"), ("PNG", "I;16"), ("WEBP", "RGB"), ("WEBP", "RGBA"), ("GIF", "P"),
            ("GIF", "L"), ("BMP", "RGB"), ("BMP", "P")]


@pytest.mark.parametrize("fmt,mode", LOSSLESS, ids=[f"{f}-{m}" for f, m in LOSSLESS])
def test_lossless_formats_decode_to_their_rgb_pixels(fmt: str, mode: str) -> None:
    im = _source(mode)
    data = _encode(im, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    got = decode_image(data, LIMITS)
    # NOTE: alpha dropped: the RGB channels as stored; palette and gray expanded to RGB
    want = _expected_rgb(Image.open(io.BytesIO(data)))
    _assert_close(got, want, 0, f"{fmt} {mode}")
    assert got.flags.writeable and got.flags.c_contiguous
    assert probe_image(data, LIMITS) == (fmt, 64, 48)


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_jpeg_decodes_like_pillow(mode: str) -> None:
    data = _encode(_source(mode), "JPEG", quality=90)
    want = _expected_rgb(Image.open(io.BytesIO(data)))
    got = decode_image(data, LIMITS)
    _assert_close(got, want, 2, f"JPEG {mode}")
    if mode == "RGB":  # and near its source, in RGB order (not BGR)
        error = np.abs(got.astype(np.int16) - _make_photo()).mean()
        swapped = np.abs(got.astype(np.int16) - _make_photo()[:, :, ::-1]).mean()
        assert error < 12 and error < swapped / 3, (error, swapped)


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_animation_gives_its_first_frame(fmt: str) -> None:
    frames = [Image.new("RGB", (16, 16), color) for color in ((200, 10, 10), (10, 200, 10))]
    data = _encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=100,
                   **({"lossless": True} if fmt == "WEBP" else {}))
    got = decode_image(data, LIMITS)
    _assert_close(got, np.asarray(frames[0]), 2, f"animated {fmt}")


@pytest.mark.parametrize("data,words", [
    (b"", ("empty",)),
    (b"hello, not an image at all", ("not a supported image format", "JPEG, PNG")),
    (_encode(Image.new("RGB", (8, 8)), "TIFF"), ("not a supported image format",)),
    (b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4, ("corrupt JPEG",)),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, ("corrupt PNG",)),
    (b"GIF89a" + b"\x01" * 5, ("corrupt GIF",)),
    (b"RIFF\x10\x00\x00\x00WEBPVP8 ", ("corrupt WEBP",)),
], ids=["empty", "text", "tiff", "jpeg-garbage", "png-garbage", "gif-header", "webp-header"])
def test_unsupported_and_corrupt_bytes_are_media_errors(data: bytes, words: tuple[str]) -> None:
    _assert_refused(data, *words)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP"])
def test_truncated_image_is_corrupt(fmt: str) -> None:
    data = _encode(Image.fromarray(_make_photo()), fmt)
    _assert_refused(data[: len(data) * 2 // 3], "corrupt")


def test_damaged_bytes_raise_only_media_errors() -> None:
    rng = np.random.default_rng(1)
    sources = [_encode(Image.fromarray(_make_photo()), fmt) for fmt in ("JPEG", "PNG", "WEBP",
                                                                      "GIF", "BMP")]
    for n in range(300):
        data = bytearray(sources[n % len(sources)])
        for pos in rng.integers(0, len(data), 4):
            data[pos] = rng.integers(0, 256)
        try:
            image = decode_image(bytes(data), LIMITS)
        except MediaError:
            continue
        assert image.ndim == 3 and image.shape[2] == 3 and image.dtype == np.uint8, image.shape


def _png_claiming(width: int, height: int) -> bytes:
    """A small real 1-bit PNG whose IHDR says width x height (CRC fixed): a bomb's header."""
    data = bytearray(_encode(Image.new("1", (64, 64)), "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def _jpeg_claiming(width: int, height: int) -> bytes:
    data = bytearray(_encode(Image.fromarray(_make_photo()), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.mark.parametrize("data", [_png_claiming(30000, 30000), _jpeg_claiming(30000, 30000)],
                         ids=["png", "jpeg"])
def test_decompression_bomb_is_refused_from_its_header(data: bytes) -> None:
    # NOTE: the pixel data does not match the header: a decode would say "corrupt" instead
    start = time.perf_counter()
    _assert_refused(data, "900 MP", "limit of 50 MP")
    with pytest.raises(MediaError, match="900 MP"):
        probe_image(data, LIMITS)
    assert time.perf_counter() - start < BOMB_S, time.perf_counter() - start


def test_real_64_mp_png_is_refused_before_decoding() -> None:
    data = _encode(Image.new("1", (8000, 8000)), "PNG")  # 8 KB, 64 MP
    start = time.perf_counter()
    _assert_refused(data, "8000x8000 = 64 MP", "limit of 50 MP")
    assert time.perf_counter() - start < BOMB_S, time.perf_counter() - start


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF", "BMP"])
def test_limits_apply_to_every_format(fmt: str) -> None:
    data = _encode(Image.fromarray(_make_photo(100, 100)), fmt)
    _assert_refused(data, "100x100 = 0.01 MP", limits=MediaLimits(max_pixels=100 * 100 - 1))
    _assert_refused(data, "more than the limit of",
                    limits=MediaLimits(max_image_bytes=len(data) - 1))
    assert decode_image(data, MediaLimits(max_pixels=100 * 100)).shape == (100, 100, 3)


def test_preprocess_normalizes_each_channel_in_rgb_order() -> None:
    image = np.zeros((30, 50, 3), np.uint8) + np.array([255, 0, 128], np.uint8)
    x = preprocess(image, 16, CLIP_MEAN, CLIP_STD)
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32, (x.shape, x.dtype)
    want = [(c / 255 - m) / s for c, m, s in zip((255, 0, 128), CLIP_MEAN, CLIP_STD, strict=True)]
    for channel in range(3):
        got = x[channel]
        assert torch.allclose(got, torch.full_like(got, want[channel]), atol=1e-5), (
            channel, got.min().item(), got.max().item(), want[channel])


def test_preprocess_at_its_own_size_is_only_normalization() -> None:
    image = _make_photo(32, 32)
    got = preprocess(image, 32, CLIP_MEAN, CLIP_STD).numpy()
    want = (image.astype(np.float64) / 255 - CLIP_MEAN) / CLIP_STD
    np.testing.assert_allclose(got, want.transpose(2, 0, 1), atol=1e-5)


@pytest.mark.parametrize("size", [96, 224, 512])
def test_preprocess_resize_matches_pillow_bicubic(size: int) -> None:
    # NOTE: Pillow's antialiased bicubic (a=-0.5) vs torch's (a=-0.75): close, never equal;
    # without antialias the 96 case differs by ~10 levels on this noisy image
    image = _make_photo(400, 300)
    got = preprocess(image, size, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)).numpy().transpose(1, 2, 0)
    want = np.asarray(Image.fromarray(image).resize((size, size), Image.BICUBIC)) / 255
    diff = np.abs(got - want) * 255
    assert diff.mean() < 1.0 and diff.max() < 12, (size, diff.mean(), diff.max())


def test_preprocess_id_names_the_parameters() -> None:
    base = preprocess_id(336, CLIP_MEAN, CLIP_STD)
    assert base == preprocess_id(336, tuple(CLIP_MEAN), list(CLIP_STD))  # type: ignore[arg-type]
    assert ":" not in base and base.startswith("img-v1-336-"), base
    others = {preprocess_id(224, CLIP_MEAN, CLIP_STD), preprocess_id(336, CLIP_STD, CLIP_STD),
              preprocess_id(336, CLIP_MEAN, CLIP_MEAN), base}
    assert len(others) == 4, others
    assert preprocess_id(8, (1, 0, 0), (1, 1, 1)) == preprocess_id(8, (1.0, 0, 0), (1, 1, 1.0))


def test_content_hash_is_sha256_of_the_bytes() -> None:
    assert content_hash(b"abc") == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    data = _encode(Image.fromarray(_make_photo()), "PNG")
    assert content_hash(data) == hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------ clips


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(2.0)


@pytest.mark.parametrize("codec,container", [("mpeg4", "mp4"), ("libvpx-vp9", "webm"),
                                             ("mpeg4", "avi")])
def test_clip_frames_are_sampled_uniformly(codec: str, container: str) -> None:
    data = make_clip(2.0, codec=codec, container=container)
    frames = decode_clip(data, LIMITS, 4)
    # NOTE: targets 0.25, 0.75, 1.25, 1.75 s show frames 2, 7, 12, 17 (10 fps)
    levels = [round(float(f.mean())) for f in frames]
    assert all(abs(got - want) <= 4 for got, want in zip(levels, (20, 70, 120, 170),
                                                         strict=True)), levels
    assert all(f.shape == (64, 64, 3) and f.dtype == np.uint8 for f in frames)


@pytest.mark.parametrize("num_frames", [1, 7, 20, 32])
def test_clip_gives_num_frames(clip: bytes, num_frames: int) -> None:
    frames = decode_clip(clip, LIMITS, num_frames)
    assert len(frames) == num_frames, len(frames)
    levels = [float(f.mean()) for f in frames]
    assert levels == sorted(levels), levels  # in time order


def test_clip_probe_reads_the_header(clip: bytes) -> None:
    info = probe_clip(clip, LIMITS)
    assert (info.format, info.codec, info.width, info.height) == ("mp4", "mpeg4", 64, 64), info
    assert abs(info.duration_s - 2.0) < 0.15 and info.keyframes_s[0] == 0.0, info


def test_long_clip_is_refused_before_decoding() -> None:
    data = make_clip(95.0, fps=1, size=16)
    with pytest.raises(MediaError, match="clip is 95 s, longer than the limit of 60 s"):
        decode_clip(data, LIMITS, 8)


@pytest.mark.parametrize("limits,words", [
    (MediaLimits(max_video_s=1.5), "clip is 2 s, longer than the limit of 1.5 s"),
    (MediaLimits(max_pixels=64 * 64 - 1), "64x64 = 0 MP"),
    (MediaLimits(max_video_bytes=1000), "more than the limit of"),
    (MediaLimits(max_frames=4), "5 frames requested; want 1 to 4"),
], ids=["duration", "pixels", "bytes", "frames"])
def test_clip_limits(clip: bytes, limits: MediaLimits, words: str) -> None:
    with pytest.raises(MediaError) as info:
        decode_clip(clip, limits, 5)
    assert words in info.value.reason, info.value.reason


@pytest.mark.parametrize("cut,words", [(0.5, "corrupt video"), (0.02, "corrupt video")])
def test_truncated_clip_is_corrupt(clip: bytes, cut: float, words: str) -> None:
    with pytest.raises(MediaError, match=words):
        decode_clip(clip[: int(len(clip) * cut)], LIMITS, 4)


@pytest.mark.parametrize("data", [b"", b"#EXTM3U\n#EXT-X-TARGETDURATION:1\nhttp://127.0.0.1/x.ts",
                                  _encode(Image.new("RGB", (8, 8)), "PNG")],
                         ids=["empty", "hls", "png"])
def test_unsupported_container_is_refused(data: bytes) -> None:
    with pytest.raises(MediaError, match="empty|not a supported video format"):
        decode_clip(data, LIMITS, 4)


# ------------------------------------------------------------------------------------ GPU


def test_gpu_module_imports_no_gpu_library() -> None:
    code = ("import sys, encoders.gpu_decode\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('cupy', 'nvidia')]\n"
            "sys.exit(f'imported {bad}' if bad else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr + result.stdout


@pytest.mark.gpu
def test_gpu_decode_matches_cpu() -> None:
    from encoders.gpu_decode import decode_images_gpu, gpu_available

    assert gpu_available(), "CUDA is here but nvidia.nvimgcodec is not: pip install " \
                            "nvidia-nvimgcodec-cu12"
    datas = [_encode(Image.fromarray(_make_photo(w, h, seed=w)), "JPEG", quality=90)
             for w, h in ((640, 480), (333, 517), (64, 48))]
    datas.append(_encode(Image.fromarray(_make_photo()).convert("L"), "JPEG"))
    datas.append(_encode(Image.fromarray(_make_photo()), "PNG"))  # the CPU fallback
    gpu = decode_images_gpu(datas, "cuda")
    for i, (data, image) in enumerate(zip(datas, gpu, strict=True)):
        assert image.device.type == "cuda", image.device
        got, want = image.cpu().numpy(), decode_image(data, LIMITS)
        _assert_close(got, want, 12, f"image {i}")
        diff = np.abs(got.astype(np.int16) - want).mean()
        assert diff < 1.0, f"image {i}: mean |diff| {diff}"


@pytest.mark.gpu
def test_gpu_preprocess_matches_cpu() -> None:
    from encoders.gpu_decode import preprocess_gpu

    images = [_make_photo(400, 300), _make_photo(50, 90, seed=3)]
    got = preprocess_gpu([torch.from_numpy(im).cuda() for im in images], 224, CLIP_MEAN,
                         CLIP_STD)
    assert got.shape == (2, 3, 224, 224) and got.is_cuda, (got.shape, got.device)
    for i, image in enumerate(images):
        want = preprocess(image, 224, CLIP_MEAN, CLIP_STD)
        assert torch.allclose(got[i].cpu(), want, atol=1e-3), (i, (got[i].cpu() - want).abs().max())
