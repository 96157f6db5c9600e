"""Image decode and preprocessing on CPU: raw bytes -> (H, W, 3) uint8 RGB -> [3, S, S] float32.

``probe_image`` sniffs the format from the magic bytes (never a declared mime type) and reads the
size from the header alone; ``decode_image`` refuses anything over ``MediaLimits`` before a pixel
is decoded (decompression bombs), then decodes JPEG with simplejpeg (libjpeg-turbo, ~1.3-2x
Pillow: loadtest/bench_media.py) and PNG, WebP, GIF and BMP with Pillow (first frame of an
animation, alpha dropped, palette and grayscale expanded to RGB). No EXIF rotation is applied.
Every failure is a ``MediaError`` whose ``reason`` a user can act on; the gateway turns it into a
400 naming the content part.

``preprocess_tensor`` is the one copy of the resize + normalize math; the CPU path
(``preprocess``) and the GPU path (``encoders.gpu_decode.preprocess_gpu``) both call it. This
module imports torch only inside those functions: the gateway imports it to check and hash media.
"""

from __future__ import annotations

import functools
import hashlib
import io
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import simplejpeg
from PIL import Image

if TYPE_CHECKING:
    import torch

MiB = 1 << 20
IMAGE_FORMATS = "JPEG, PNG, WebP, GIF, BMP"
PREPROCESS_VERSION = "v1"  # NOTE: bump when decode or preprocess math changes (cache keys)


class MediaError(ValueError):
    """Media that cannot be used, with a ``reason`` the user can act on (a 400, never a 500)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """What one request may send. ``max_pixels`` is width x height of one image or video frame,
    checked from the header before decoding; it may not exceed Pillow's own guard
    (``Image.MAX_IMAGE_PIXELS``, ~89 MP), which raises above it too."""

    max_image_bytes: int = 20 * MiB
    max_pixels: int = 50_000_000
    max_video_bytes: int = 100 * MiB
    max_video_s: float = 60.0
    max_frames: int = 32
    fetch_timeout_s: float = 10.0
    max_images_per_request: int = 16

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_pixels", "max_video_bytes", "max_video_s",
                     "max_frames", "fetch_timeout_s", "max_images_per_request"):
            assert getattr(self, name) > 0, f"{name}={getattr(self, name)}: must be > 0"
        pillow_max = Image.MAX_IMAGE_PIXELS or 0
        assert not pillow_max or self.max_pixels <= pillow_max, (
            f"max_pixels={self.max_pixels}: at most Pillow's Image.MAX_IMAGE_PIXELS={pillow_max}")


class ImageInfo(NamedTuple):
    format: str  # "JPEG", "PNG", "WEBP", "GIF" or "BMP"
    width: int
    height: int


def content_hash(data: bytes) -> str:
    """sha256 hex digest of the raw media bytes (the content part of an embedding cache key)."""
    return hashlib.sha256(data).hexdigest()


def sniff_image_format(data: bytes) -> str | None:
    """The image format named by the magic bytes, or None for anything else."""
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def probe_image(data: bytes, limits: MediaLimits) -> ImageInfo:
    """Format and size from the header only; nothing is decoded.

    Raises:
        MediaError: not a supported format, a header that does not parse, more than
            ``limits.max_image_bytes`` or ``limits.max_pixels``.
    """
    _check_bytes(len(data), limits.max_image_bytes, "image")
    fmt = sniff_image_format(data)
    if fmt is None:
        raise MediaError(f"not a supported image format ({IMAGE_FORMATS})")
    if fmt == "JPEG":
        height, width, _ = _jpeg_header(data)
    else:
        with _open_pillow(data, fmt, limits) as im:
            width, height = im.size
    check_pixels(width, height, limits, "image")
    return ImageInfo(fmt, width, height)


def decode_image(data: bytes, limits: MediaLimits) -> np.ndarray:
    """Decode one image to a writable, C-contiguous (H, W, 3) uint8 RGB array.

    Raises:
        MediaError: unsupported format, corrupt or truncated data, too many bytes or pixels
            (checked from the header, before decoding). No other exception escapes.
    """
    _check_bytes(len(data), limits.max_image_bytes, "image")
    fmt = sniff_image_format(data)
    if fmt is None:
        raise MediaError(f"not a supported image format ({IMAGE_FORMATS})")
    if fmt == "JPEG":
        height, width, colorspace = _jpeg_header(data)
        check_pixels(width, height, limits, "image")
        if colorspace not in ("CMYK", "YCCK"):  # NOTE: libjpeg-turbo cannot convert these to RGB
            return _decode_jpeg(data)
    with _open_pillow(data, fmt, limits) as im:
        check_pixels(im.width, im.height, limits, "image")
        try:
            return _pillow_to_rgb(im)
        except Exception as exc:  # NOTE: Pillow raises OSError, SyntaxError, EOFError, ...
            raise MediaError(f"corrupt {fmt} data: {exc}") from None


def check_pixels(width: int, height: int, limits: MediaLimits, what: str) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(f"{what} has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:
        raise MediaError(f"{what} is {width}x{height} = {_mp(width * height)} MP, more than "
                         f"the limit of {_mp(limits.max_pixels)} MP")


def preprocess(image: np.ndarray, image_size: int, mean: tuple[float, ...],
               std: tuple[float, ...]) -> torch.Tensor:
    """(H, W, 3) uint8 RGB -> [3, S, S] float32 on CPU (see ``preprocess_tensor``)."""
    import torch

    assert image.ndim == 3 and image.shape[2] == 3 and image.dtype == np.uint8, (
        f"image {image.shape} {image.dtype}: want (H, W, 3) uint8")
    return preprocess_tensor(torch.from_numpy(np.ascontiguousarray(image)), image_size, mean, std)


def preprocess_tensor(image: torch.Tensor, image_size: int, mean: tuple[float, ...],
                      std: tuple[float, ...]) -> torch.Tensor:
    """(H, W, 3) uint8 RGB on any device -> [3, S, S] float32 on that device: bicubic resize with
    antialias to S x S on float 0..255, clamp to [0, 255], scale to [0, 1], ``(x - mean) / std``
    per channel. The one copy of this math: CPU and GPU compute the same."""
    import torch
    import torch.nn.functional as F

    assert len(mean) == 3 and len(std) == 3, f"mean={mean} std={std}: one value per channel"
    x = image.permute(2, 0, 1).unsqueeze(0).to(torch.float32)
    if tuple(x.shape[2:]) != (image_size, image_size):
        x = F.interpolate(x, size=(image_size, image_size), mode="bicubic", antialias=True,
                          align_corners=False)
    x = x[0].clamp_(0.0, 255.0).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(3, 1, 1)
    return x.sub_(m).div_(s).contiguous()


def preprocess_id(image_size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> str:
    """A stable name of decode + ``preprocess`` with these parameters, for cache keys (no ':').

    >>> preprocess_id(336, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))[:21]
    'img-v1-336-bicubicaa-'
    """
    params = repr((tuple(float(m) for m in mean), tuple(float(s) for s in std)))
    digest = hashlib.sha256(params.encode()).hexdigest()[:16]
    return f"img-{PREPROCESS_VERSION}-{image_size}-bicubicaa-{digest}"


_MAGIC = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
)
_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")


def _check_bytes(num_bytes: int, limit: int, what: str) -> None:
    if num_bytes == 0:
        raise MediaError(f"{what} is empty (0 bytes)")
    if num_bytes > limit:
        raise MediaError(f"{what} is {_mib(num_bytes)} MiB, more than the limit of "
                         f"{_mib(limit)} MiB")


def _jpeg_header(data: bytes) -> tuple[int, int, str]:
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except Exception as exc:  # NOTE: simplejpeg raises ValueError, or anything libjpeg says
        raise MediaError(f"corrupt JPEG data: {exc}") from None
    return height, width, colorspace


def _decode_jpeg(data: bytes) -> np.ndarray:
    try:
        # NOTE: strict: a truncated or damaged stream raises instead of decoding to gray
        return simplejpeg.decode_jpeg(data, colorspace="RGB", strict=True)
    except Exception as exc:
        raise MediaError(f"corrupt JPEG data: {exc}") from None


def _open_pillow(data: bytes, fmt: str, limits: MediaLimits) -> Image.Image:
    """Image.open restricted to the sniffed format; reads the header, decodes nothing."""
    _harden_pillow()
    try:
        return Image.open(io.BytesIO(data), formats=[fmt])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        match = _BOMB_PIXELS.search(str(exc))
        size = f"{_mp(int(match[1]))} MP" if match else "too large"
        raise MediaError(f"image is {size}, more than the limit of "
                         f"{_mp(limits.max_pixels)} MP") from None
    except Image.UnidentifiedImageError:
        raise MediaError(f"corrupt {fmt} data: the header does not parse") from None
    except Exception as exc:
        raise MediaError(f"corrupt {fmt} data: {exc}") from None


@functools.cache
def _harden_pillow() -> None:
    # NOTE: Pillow only warns between MAX_IMAGE_PIXELS and twice that; make it raise (Pillow's
    # documented way). Process-wide and idempotent; our own header check runs first anyway.
    warnings.filterwarnings("error", category=Image.DecompressionBombWarning)


def _pillow_to_rgb(im: Image.Image) -> np.ndarray:
    if im.mode.startswith("I;16"):  # 16-bit grayscale PNG: keep the high byte, not a clip
        gray = (np.asarray(im).astype(np.uint16) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if im.mode in ("P", "PA") and "transparency" in im.info:
        im = im.convert("RGBA")  # NOTE: P -> RGB with transparency warns; alpha dropped below
    if im.mode != "RGB":
        im = im.convert("RGB")
    return np.array(im, dtype=np.uint8)  # NOTE: a copy: np.asarray(im) is read-only


def _mp(pixels: int) -> str:
    return f"{round(pixels / 1e6, 2):g}"


def _mib(num_bytes: int) -> str:
    return f"{round(num_bytes / MiB, 1):g}"
