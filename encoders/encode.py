"""The encode function the encoder service batches into: raw media bytes -> image-token embeddings.

``MediaEncoder(datas)`` takes one batch of raw (still compressed) items and returns, per item,
a ``[tokens, out_hidden_size]`` tensor or the exception that item failed with::

    sniff magic bytes   image (JPEG, PNG, WebP, GIF, BMP)   -> 1 frame
                        video (MP4/MOV, WebM/MKV, AVI)      -> num_frames frames, uniform in time
    decode              JPEG batch on the GPU (nvJPEG) when the device is CUDA and nvImageCodec
                        is there; else on CPU threads (simplejpeg / Pillow / PyAV)
    preprocess          bicubic resize + normalize on the tower's device (``media.preprocess``)
    tower               every frame of the batch together, ``max_tower_batch`` at a time
    split               image: [tokens_per_image, H]; video: [num_frames * tokens_per_image, H]

A bad item (unsupported, corrupt, over ``MediaLimits``) fails alone with its ``MediaError``; the
others are encoded. ``description`` is what the service answers ``Describe`` with, so a gateway
keys and sizes media exactly as this encoder does.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from encoders.gpu_decode import decode_images_gpu, gpu_available, preprocess_gpu
from encoders.media import (
    IMAGE_FORMATS,
    MediaError,
    MediaLimits,
    decode_image,
    preprocess_id,
    preprocess_tensor,
    sniff_image_format,
)
from encoders.protocol import Description, ItemKind
from encoders.video import VIDEO_FORMATS, decode_clip, sniff_video_format
from encoders.vision import VisionTower, load_tower, tower_fingerprint
from encoders.vision_config import VisionConfig

__all__ = ["MediaEncoder", "encode_preprocess_id", "load_media_encoder", "make_encode_fn"]

logger = logging.getLogger(__name__)

DEFAULT_NUM_FRAMES = 8
DEFAULT_MAX_TOWER_BATCH = 32
CLIP_VERSION = "v1"  # NOTE: bump when frame sampling (encoders.video) changes (cache keys)

_T = TypeVar("_T")


class MediaEncoder:
    """Decode + preprocess + vision tower of one batch (an ``encoders.service.EncodeFn``).

    Args:
        config, state: the tower's geometry and weights (``VisionTower.state_dict()`` names).
        device, dtype: where and in what the tower runs (the pixels are float32 until then).
        limits: what one item may be (bytes, pixels, clip length, frames).
        num_frames: frames sampled from a video clip (1..``limits.max_frames``).
        max_tower_batch: the most frames in one tower forward.
        num_threads: CPU decode threads (default: one per core).

    Raises:
        ValueError: ``num_frames`` or ``max_tower_batch`` out of range, or a ``device`` of a
            kind this machine does not have.

    NOTE: call from one thread at a time (the service's batch thread).
    """

    def __init__(self, config: VisionConfig, state: dict[str, torch.Tensor], *,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 limits: MediaLimits | None = None, num_frames: int = DEFAULT_NUM_FRAMES,
                 max_tower_batch: int = DEFAULT_MAX_TOWER_BATCH,
                 num_threads: int | None = None) -> None:
        self.limits = limits or MediaLimits()
        _check_args(num_frames, max_tower_batch, self.limits)
        self.config, self.num_frames, self.max_tower_batch = config, num_frames, max_tower_batch
        self.device = _check_device(device)
        self.num_threads = num_threads or os.cpu_count() or 1
        self.tower = _build_tower(config, state, self.device, dtype)
        self.tower_fingerprint = tower_fingerprint(config, self.tower.state_dict())
        self.preprocess_id = encode_preprocess_id(config, num_frames)
        self.tokens_per_image = config.tokens_per_image
        self.hidden_size = config.out_hidden_size
        self.description = Description(
            tokens_per_image=self.tokens_per_image, num_frames=num_frames,
            preprocess_id=self.preprocess_id, tower_fingerprint=self.tower_fingerprint,
            hidden_size=self.hidden_size)
        # NOTE: chosen once: nvJPEG batches on a CUDA device with nvImageCodec, CPU threads else
        self.is_gpu_decode = self.device.type == "cuda" and gpu_available()

    def tokens_for(self, kind: ItemKind) -> int:
        """Embedding rows of one item of ``kind`` (a video: ``num_frames`` frames)."""
        return self.description.tokens_for(kind)

    def __call__(self, datas: list[bytes]) -> list[torch.Tensor | Exception]:
        """One embedding per item, in order: a float CPU tensor ``[tokens, hidden_size]``
        (``tokens_for`` its kind), or the exception that item failed with (a ``MediaError`` for
        bad media). An error of the tower itself raises (the whole batch fails)."""
        pixels = self._pixels_gpu(datas) if self.is_gpu_decode else self._map(self._load, datas)
        ok = [p for p in pixels if isinstance(p, torch.Tensor)]
        embeds = iter(self._encode(ok))
        return [next(embeds) if isinstance(p, torch.Tensor) else p for p in pixels]

    def frames(self, data: bytes) -> list[np.ndarray]:
        """The (H, W, 3) uint8 RGB frames of one item: 1 for an image, ``num_frames`` for a clip.

        Raises:
            MediaError: neither a supported image nor video, or decoding failed.
        """
        if sniff_image_format(data) is not None:
            return [decode_image(data, self.limits)]
        if sniff_video_format(data) is not None:
            return decode_clip(data, self.limits, self.num_frames)
        raise MediaError(f"not a supported image ({IMAGE_FORMATS}) or video "
                         f"({VIDEO_FORMATS}) format")

    # ------------------------------------------------------------------ stages

    def _load(self, data: bytes) -> torch.Tensor:
        """Decode on the CPU, preprocess on the tower's device: [frames, 3, S, S] float32."""
        return self._preprocess([torch.from_numpy(f) for f in self.frames(data)])

    def _preprocess(self, frames: list[torch.Tensor]) -> torch.Tensor:
        cfg = self.config
        return torch.stack([preprocess_tensor(f.to(self.device), cfg.image_size, cfg.image_mean,
                                              cfg.image_std) for f in frames])

    def _pixels_gpu(self, datas: list[bytes]) -> list[torch.Tensor | Exception]:
        """Images in one nvJPEG batch (``decode_images_gpu``), the rest on CPU threads."""
        is_image = [sniff_image_format(d) is not None for d in datas]
        images = iter(self._decode_gpu([d for d, ok in zip(datas, is_image) if ok]))
        others = iter(self._map(self._load, [d for d, ok in zip(datas, is_image) if not ok]))
        return [next(images) if ok else next(others) for ok in is_image]

    def _decode_gpu(self, datas: list[bytes]) -> list[torch.Tensor | Exception]:
        if not datas:
            return []
        cfg = self.config
        try:
            frames = decode_images_gpu(datas, self.device, self.limits)
        except Exception:  # noqa: BLE001 (it names only the first bad item: isolate each one)
            return [_call(self._decode_gpu_one, d) for d in datas]
        return list(preprocess_gpu(frames, cfg.image_size, cfg.image_mean,
                                   cfg.image_std).unsqueeze(1))

    def _decode_gpu_one(self, data: bytes) -> torch.Tensor:
        try:
            return self._preprocess(decode_images_gpu([data], self.device, self.limits))
        except MediaError as exc:
            raise MediaError(exc.reason.removeprefix("image 0: ")) from None

    def _encode(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tower over every frame of ``pixels`` (each [frames, 3, S, S]), split per item."""
        if not pixels:
            return []
        sizes = [p.shape[0] for p in pixels]
        step = self.max_tower_batch
        with torch.inference_mode():
            x = torch.cat(pixels)
            out = torch.cat([self.tower(x[i:i + step]) for i in range(0, x.shape[0], step)])
        # NOTE: clone outside inference mode: a plain tensor that owns its own storage, not a
        # view that would keep the whole batch alive in the embedding cache
        out = out.to("cpu")
        return [part.reshape(-1, self.hidden_size).clone() for part in out.split(sizes)]

    def _map(self, fn: Callable[[bytes], _T], datas: Sequence[bytes]) -> list[_T | Exception]:
        """``fn`` over ``datas`` on CPU threads (decoders release the GIL); an exception is that
        item's result."""
        if len(datas) <= 1 or self.num_threads == 1:
            return [_call(fn, d) for d in datas]
        with ThreadPoolExecutor(min(len(datas), self.num_threads),
                                thread_name_prefix="encode-decode") as pool:
            return list(pool.map(lambda d: _call(fn, d), datas))


def encode_preprocess_id(config: VisionConfig, num_frames: int) -> str:
    """The ``preprocess_id`` of every key this encoder makes: the image preprocessing
    (``media.preprocess_id``) plus the clip sampling (version, frames); no ':'.

    >>> from encoders.vision_config import demo_vision_config
    >>> encode_preprocess_id(demo_vision_config(64), 8).endswith("-clip-v1-8f")
    True
    """
    image = preprocess_id(config.image_size, config.image_mean, config.image_std)
    return f"{image}-clip-{CLIP_VERSION}-{num_frames}f"


def load_media_encoder(model_dir: str | Path, device: str | torch.device = "cpu",
                       limits: MediaLimits | None = None,
                       num_frames: int = DEFAULT_NUM_FRAMES, *,
                       dtype: torch.dtype = torch.float32,
                       max_tower_batch: int = DEFAULT_MAX_TOWER_BATCH) -> MediaEncoder | None:
    """The encoder of ``model_dir``'s vision tower (``vision_tower.safetensors`` or a combined
    checkpoint, and the vision config: ``encoders.vision.load_tower``), or None when the model
    has no tower.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: an invalid vision config, tower tensors that do not match it
            (``VisionCheckpointError``), or arguments out of range.
    """
    device = _check_device(device)
    tower = load_tower(model_dir, dtype=dtype, device=device)
    if tower is None:
        return None
    return MediaEncoder(tower.cfg, tower.state_dict(), device=device, dtype=dtype,
                        limits=limits, num_frames=num_frames, max_tower_batch=max_tower_batch)


def make_encode_fn(args: argparse.Namespace) -> MediaEncoder:
    """The encoder of ``--model`` on ``--device`` (``encoders.cli``'s ``make_encode_fn``).

    Raises:
        ValueError: no ``--model``, a dir without config.json or vision tower, a bad device.
    """
    if not args.model:
        raise ValueError("--model DIR is required: the model directory holding the vision "
                         "tower (vision_tower.safetensors and config.json's vision_config)")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        encoder = load_media_encoder(args.model, device, num_frames=args.num_frames)
    except FileNotFoundError as exc:
        raise ValueError(f"--model {args.model}: {exc}") from None
    if encoder is None:
        raise ValueError(f"--model {args.model}: the model has no vision tower (its config.json "
                         "has no vision_config); serve the encoder from a multimodal model dir")
    logger.info("encoder: %s on %s (%s decode), %d tokens per image, %d frames per clip, "
                "tower %s", args.model, encoder.device, "nvJPEG" if encoder.is_gpu_decode
                else "CPU", encoder.tokens_per_image, encoder.num_frames,
                encoder.tower_fingerprint)
    return encoder


def _check_args(num_frames: int, max_tower_batch: int, limits: MediaLimits) -> None:
    if not 1 <= num_frames <= limits.max_frames:
        raise ValueError(f"num_frames={num_frames}: want 1 to max_frames={limits.max_frames}")
    if max_tower_batch < 1:
        raise ValueError(f"max_tower_batch={max_tower_batch}: must be >= 1")


def _check_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: want cpu or cuda")
    return dev


def _build_tower(config: VisionConfig, state: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> VisionTower:
    with torch.device("meta"):
        tower = VisionTower(config)
    tower.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()},
                          assign=True)
    return tower.eval().requires_grad_(False)


def _call(fn: Callable[[bytes], _T], data: bytes) -> _T | Exception:
    try:
        return fn(data)
    except MediaError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 (a bug, or a decoder's surprise: one item fails)
        logger.warning("encoder: an item failed unexpectedly", exc_info=True)
        return exc
