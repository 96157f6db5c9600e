"""Batched image decode on the GPU (nvJPEG through NVIDIA nvImageCodec) and the GPU twin of
``encoders.media.preprocess``.

The library is ``nvidia.nvimgcodec`` (pip ``nvidia-nvimgcodec-cu12``): one ``Decoder.decode``
call takes a batch of encoded JPEGs and runs nvJPEG (the hardware JPEG engine where the GPU has
one, CUDA kernels otherwise); its images expose ``__cuda_array_interface__``, which torch wraps
without a copy. cupy is not needed: it has no nvJPEG binding, and a hand-written ctypes binding
of libnvjpeg's batched API would be ~300 lines of unsafe code to keep in step with CUDA. Without
nvimgcodec (or CUDA) ``gpu_available()`` is False and callers decode on the CPU (``media``).

Everything GPU-only is imported inside functions (``import encoders.gpu_decode`` works on CPU).
Limits are checked from the headers on the CPU first, as in ``media.decode_image``. Only JPEG goes
to the GPU; other formats decode on the CPU and are copied over. nvJPEG and libjpeg-turbo differ by
a few levels on some pixels (IDCT and chroma upsampling rounding): tests/encoders/test_media.py
bounds that. No EXIF rotation is applied, as on the CPU.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from encoders.media import (
    ImageInfo,
    MediaError,
    MediaLimits,
    decode_image,
    preprocess_tensor,
    probe_image,
)

if TYPE_CHECKING:
    import torch


@functools.cache
def gpu_available() -> bool:
    """Whether CUDA and nvidia.nvimgcodec are both importable and usable (False on CPU boxes)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        from nvidia import nvimgcodec  # noqa: F401
    except ImportError:
        return False
    return True


def decode_images_gpu(datas: list[bytes], device: torch.device | str,
                      limits: MediaLimits | None = None) -> list[torch.Tensor]:
    """Decode a batch to (H, W, 3) uint8 RGB tensors on ``device`` (CUDA), in input order: the
    JPEGs in one nvJPEG batch, the rest (and any JPEG nvJPEG rejects) on the CPU. Ordered on
    torch's current stream of ``device``. Call from one thread (the decoder is per device).

    Raises:
        MediaError: the first item that is unsupported, corrupt or over ``limits``, with its
            index ("image 2: ...").
    """
    import torch

    limits = limits or MediaLimits()
    device = torch.device(device)
    infos = [_probe(i, data, limits) for i, data in enumerate(datas)]
    jpegs = [i for i, info in enumerate(infos) if info.format == "JPEG"]
    out: list[torch.Tensor | None] = [None] * len(datas)
    for i, image in zip(jpegs, _nvjpeg_decode([datas[i] for i in jpegs], device), strict=True):
        out[i] = image
    for i, image in enumerate(out):
        if image is None:
            out[i] = _decode_cpu(i, datas[i], limits, device)
    return [image for image in out if image is not None]


def preprocess_gpu(images: list[torch.Tensor], image_size: int, mean: tuple[float, ...],
                   std: tuple[float, ...]) -> torch.Tensor:
    """[N, 3, S, S] float32 on the images' device; the same math as ``media.preprocess``."""
    import torch

    return torch.stack([preprocess_tensor(image, image_size, mean, std) for image in images])


def _probe(index: int, data: bytes, limits: MediaLimits) -> ImageInfo:
    try:
        return probe_image(data, limits)
    except MediaError as exc:
        raise MediaError(f"image {index}: {exc.reason}") from None


def _decode_cpu(index: int, data: bytes, limits: MediaLimits,
                device: torch.device) -> torch.Tensor:
    import torch

    try:
        return torch.from_numpy(decode_image(data, limits)).to(device)
    except MediaError as exc:
        raise MediaError(f"image {index}: {exc.reason}") from None


def _nvjpeg_decode(datas: list[bytes], device: torch.device) -> list[torch.Tensor | None]:
    """One batched decode; None where nvImageCodec could not decode an item."""
    import torch
    from nvidia import nvimgcodec

    if not datas:
        return []
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.RGB,
                                     allow_any_depth=False, apply_exif_orientation=False)
    images = _decoder(index).decode(datas, params=params, cuda_stream=stream.cuda_stream)
    # NOTE: zero copy; the tensor keeps the nvimgcodec image alive. Decoding ran on torch's
    # current stream, so later torch work on that stream sees the pixels.
    return [None if image is None else torch.as_tensor(image, device=device)
            for image in images]


@functools.cache
def _decoder(device_index: int) -> Any:
    from nvidia import nvimgcodec

    return nvimgcodec.Decoder(device_id=device_index)
